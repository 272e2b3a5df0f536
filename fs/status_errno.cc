#include "fs/status_errno.h"

#include <cerrno>

#include <spdlog/spdlog.h>

namespace weightfs {

int StatusToErrno(const Status& status, ErrnoContext context, std::string_view operation) {
  const bool commit = context == ErrnoContext::kCommit;
  int err = EIO;
  switch (status.kind()) {
    case ErrorKind::kOk: return 0;
    case ErrorKind::kNotFound:
      err = context == ErrnoContext::kXattr ? ENODATA : context == ErrnoContext::kData ? EIO : ENOENT;
      break;
    case ErrorKind::kInvalidArgument: err = EINVAL; break;
    case ErrorKind::kConflict: err = EEXIST; break;
    case ErrorKind::kUnsupported: err = ENOTSUP; break;
    // Out of a memory budget or a decode cap while reading: the reader could not be served
    // with the memory it was given. Changing or publishing: the staging disk or the bucket is full.
    case ErrorKind::kResourceExhausted:
      err = commit || context == ErrnoContext::kChange ? ENOSPC : ENOMEM;
      break;
    // Corrupt payloads, failed or timed-out bucket requests (after the store's bounded
    // retries), refused credentials: the bytes cannot be produced. ETIMEDOUT or EACCES would
    // mislead a reader about the file itself; the log line says what happened.
    // (A commit that waited out its --timeout for the other parts: ETIMEDOUT, `weightfs
    // commit` exits 124.)
    case ErrorKind::kTimeout:
      err = commit ? ETIMEDOUT : EIO;
      break;
    case ErrorKind::kCorruption:
    case ErrorKind::kIOError:
    case ErrorKind::kAuth: err = EIO; break;
    case ErrorKind::kNotEmpty: err = ENOTEMPTY; break;
    case ErrorKind::kIsDirectory: err = EISDIR; break;
    case ErrorKind::kNotDirectory: err = ENOTDIR; break;
    case ErrorKind::kBusy: err = EBUSY; break;
    case ErrorKind::kPermissionDenied: err = EPERM; break;
    case ErrorKind::kReadOnly: err = EROFS; break;
    case ErrorKind::kCrossDevice: err = EXDEV; break;
    case ErrorKind::kStale: err = ESTALE; break;
    case ErrorKind::kNameTooLong: err = ENAMETOOLONG; break;
    case ErrorKind::kBadHandle: err = EBADF; break;
    case ErrorKind::kNoAttribute: err = ENODATA; break;
    case ErrorKind::kOutOfRange: err = ERANGE; break;
  }
  switch (err) {
    case EIO:
    case ENOMEM:
    case ENOSPC: spdlog::error("{}: {} (errno {})", operation, status.ToString(), err); break;
    case EEXIST:
    case EBUSY:
    case ETIMEDOUT:
      if (commit) {
        spdlog::warn("{}: {} (errno {})", operation, status.ToString(), err);
        break;
      }
      [[fallthrough]];
    default: spdlog::debug("{}: {}", operation, status.ToString()); break;
  }
  return err;
}

}  // namespace weightfs
