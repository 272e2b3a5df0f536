// StatusToErrno: the one mapping from a Status to the errno of a FUSE reply, per context.
#include "fs/status_errno.h"

#include <cerrno>
#include <utility>

#include <gtest/gtest.h>

namespace weightfs {
namespace {

int Errno(ErrorKind kind, ErrnoContext context) {
  return StatusToErrno(kind == ErrorKind::kOk ? Status::Ok() : Status(kind, "test"), context, "test");
}

TEST(StatusErrnoTest, NotFoundDependsOnWhatTheRequestWasAbout) {
  EXPECT_EQ(Errno(ErrorKind::kNotFound, ErrnoContext::kName), ENOENT);
  EXPECT_EQ(Errno(ErrorKind::kNotFound, ErrnoContext::kXattr), ENODATA);
  EXPECT_EQ(Errno(ErrorKind::kNotFound, ErrnoContext::kData), EIO);  // a pack the bucket lost
  EXPECT_EQ(Errno(ErrorKind::kNotFound, ErrnoContext::kCommit), ENOENT);
}

TEST(StatusErrnoTest, ReadsAndCommitsMapTheSameKindsTheirOwnWay) {
  EXPECT_EQ(Errno(ErrorKind::kOk, ErrnoContext::kData), 0);
  EXPECT_EQ(Errno(ErrorKind::kInvalidArgument, ErrnoContext::kName), EINVAL);
  // A commit refused because something is in use (a file open for writing, a commit already
  // running) is Busy; InvalidArgument is EINVAL there as everywhere.
  EXPECT_EQ(Errno(ErrorKind::kInvalidArgument, ErrnoContext::kCommit), EINVAL);
  EXPECT_EQ(Errno(ErrorKind::kBusy, ErrnoContext::kCommit), EBUSY);
  EXPECT_EQ(Errno(ErrorKind::kResourceExhausted, ErrnoContext::kData), ENOMEM);
  EXPECT_EQ(Errno(ErrorKind::kResourceExhausted, ErrnoContext::kCommit), ENOSPC);
  EXPECT_EQ(Errno(ErrorKind::kConflict, ErrnoContext::kCommit), EEXIST);
  for (ErrorKind k : {ErrorKind::kCorruption, ErrorKind::kIOError, ErrorKind::kTimeout, ErrorKind::kAuth}) {
    EXPECT_EQ(Errno(k, ErrnoContext::kData), EIO);
    if (k != ErrorKind::kTimeout) {
      EXPECT_EQ(Errno(k, ErrnoContext::kCommit), EIO);
    }
  }
  // A commit that waited out its --timeout for the other parts (docs/parts.md): `weightfs
  // commit` exits 124 on ETIMEDOUT.
  EXPECT_EQ(Errno(ErrorKind::kTimeout, ErrnoContext::kCommit), ETIMEDOUT);
}

TEST(StatusErrnoTest, ChangesRunOutOfDiskNotMemory) {
  EXPECT_EQ(Errno(ErrorKind::kResourceExhausted, ErrnoContext::kChange), ENOSPC);
  EXPECT_EQ(Errno(ErrorKind::kNotFound, ErrnoContext::kChange), ENOENT);
  EXPECT_EQ(Errno(ErrorKind::kInvalidArgument, ErrnoContext::kChange), EINVAL);
}

TEST(StatusErrnoTest, FileSystemKindsMapToTheirErrnoInEveryContext) {
  const std::pair<ErrorKind, int> kinds[] = {
      {ErrorKind::kNotEmpty, ENOTEMPTY},     {ErrorKind::kIsDirectory, EISDIR},
      {ErrorKind::kNotDirectory, ENOTDIR},   {ErrorKind::kBusy, EBUSY},
      {ErrorKind::kPermissionDenied, EPERM}, {ErrorKind::kReadOnly, EROFS},
      {ErrorKind::kCrossDevice, EXDEV},      {ErrorKind::kStale, ESTALE},
      {ErrorKind::kNameTooLong, ENAMETOOLONG}, {ErrorKind::kBadHandle, EBADF},
      {ErrorKind::kNoAttribute, ENODATA},    {ErrorKind::kOutOfRange, ERANGE},
      {ErrorKind::kConflict, EEXIST},        {ErrorKind::kUnsupported, ENOTSUP},
  };
  for (auto [kind, err] : kinds) {
    for (ErrnoContext c : {ErrnoContext::kName, ErrnoContext::kData, ErrnoContext::kXattr, ErrnoContext::kChange,
                           ErrnoContext::kCommit}) {
      EXPECT_EQ(Errno(kind, c), err) << ErrorKindName(kind);
    }
  }
}

}  // namespace
}  // namespace weightfs
