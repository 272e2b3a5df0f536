#include "fs/status_errno.h"

#include <cerrno>

#include <spdlog/spdlog.h>

namespace weightfs {

int StatusToErrno(const Status& status, ErrnoContext context, std::string_view operation) {
  int err = EIO;
  switch (status.kind()) {
    case ErrorKind::kOk: return 0;
    case ErrorKind::kNotFound:
      err = context == ErrnoContext::kName || context == ErrnoContext::kCommit ? ENOENT
            : context == ErrnoContext::kXattr                                  ? ENODATA
                                                                               : EIO;
      break;
    case ErrorKind::kInvalidArgument: err = context == ErrnoContext::kCommit ? EBUSY : EINVAL; break;
    case ErrorKind::kConflict: err = EEXIST; break;
    case ErrorKind::kUnsupported: err = ENOTSUP; break;
    // Out of a memory budget or a decode cap while reading: the reader could not be served
    // with the memory it was given. Publishing: the staging disk or the bucket is full.
    case ErrorKind::kResourceExhausted: err = context == ErrnoContext::kCommit ? ENOSPC : ENOMEM; break;
    // Corrupt payloads, failed or timed-out bucket requests (after the store's bounded
    // retries), refused credentials: the bytes cannot be produced. ETIMEDOUT or EACCES would
    // mislead a reader about the file itself; the log line says what happened.
    case ErrorKind::kCorruption:
    case ErrorKind::kIOError:
    case ErrorKind::kTimeout:
    case ErrorKind::kAuth: err = EIO; break;
  }
  if (err == ENOENT || err == ENODATA || err == EINVAL) {
    spdlog::debug("{}: {}", operation, status.ToString());
  } else if (context == ErrnoContext::kCommit && (err == EEXIST || err == EBUSY)) {
    spdlog::warn("{}: {} (errno {})", operation, status.ToString(), err);
  } else {
    spdlog::error("{}: {} (errno {})", operation, status.ToString(), err);
  }
  return err;
}

}  // namespace weightfs
