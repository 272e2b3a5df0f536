// StatusToErrno: the one mapping from a Status to the errno of a FUSE reply, per context.
#include "fs/status_errno.h"

#include <cerrno>

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
  EXPECT_EQ(Errno(ErrorKind::kInvalidArgument, ErrnoContext::kCommit), EBUSY);
  EXPECT_EQ(Errno(ErrorKind::kResourceExhausted, ErrnoContext::kData), ENOMEM);
  EXPECT_EQ(Errno(ErrorKind::kResourceExhausted, ErrnoContext::kCommit), ENOSPC);
  EXPECT_EQ(Errno(ErrorKind::kConflict, ErrnoContext::kCommit), EEXIST);
  for (ErrorKind k : {ErrorKind::kCorruption, ErrorKind::kIOError, ErrorKind::kTimeout, ErrorKind::kAuth}) {
    EXPECT_EQ(Errno(k, ErrnoContext::kData), EIO);
    EXPECT_EQ(Errno(k, ErrnoContext::kCommit), EIO);
  }
}

}  // namespace
}  // namespace weightfs
