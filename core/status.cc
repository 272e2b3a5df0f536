#include "core/status.h"

#include <cerrno>
#include <cstring>
#include <exception>
#include <new>

namespace weightfs {

std::string_view ErrorKindName(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kOk: return "OK";
    case ErrorKind::kNotFound: return "NotFound";
    case ErrorKind::kCorruption: return "Corruption";
    case ErrorKind::kInvalidArgument: return "InvalidArgument";
    case ErrorKind::kIOError: return "IOError";
    case ErrorKind::kConflict: return "Conflict";
    case ErrorKind::kTimeout: return "Timeout";
    case ErrorKind::kAuth: return "Auth";
    case ErrorKind::kResourceExhausted: return "ResourceExhausted";
    case ErrorKind::kUnsupported: return "Unsupported";
    case ErrorKind::kNotEmpty: return "NotEmpty";
    case ErrorKind::kIsDirectory: return "IsDirectory";
    case ErrorKind::kNotDirectory: return "NotDirectory";
    case ErrorKind::kBusy: return "Busy";
    case ErrorKind::kPermissionDenied: return "PermissionDenied";
    case ErrorKind::kReadOnly: return "ReadOnly";
    case ErrorKind::kCrossDevice: return "CrossDevice";
    case ErrorKind::kStale: return "Stale";
    case ErrorKind::kNameTooLong: return "NameTooLong";
    case ErrorKind::kBadHandle: return "BadHandle";
    case ErrorKind::kNoAttribute: return "NoAttribute";
    case ErrorKind::kOutOfRange: return "OutOfRange";
  }
  return "Unknown";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string s(ErrorKindName(kind_));
  s += ": ";
  s += message_;
  return s;
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  std::string m(context);
  m += ": ";
  m += message_;
  return Status(kind_, std::move(m));
}

Status StatusOfErrno(int err, std::string_view what) {
  std::string m(what);
  m += ": ";
  m += std::strerror(err);
  switch (err) {
    case ENOSPC:
    case EDQUOT: return Status::ResourceExhausted(std::move(m));
    case ENOENT: return Status::NotFound(std::move(m));
    default: return Status::IOError(std::move(m));
  }
}

Status StatusOfCurrentException(std::string_view context) noexcept {
  ErrorKind kind = ErrorKind::kIOError;
  std::string_view what = "unknown exception";
  try {
    throw;
  } catch (const std::bad_alloc&) {
    kind = ErrorKind::kResourceExhausted;
    what = "out of memory";
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
  }
  try {
    std::string m(context);
    m += ": ";
    m += what;
    return Status(kind, std::move(m));
  } catch (...) {
    // No memory for the message: a Status whose message is empty still has its kind.
    return Status(kind, std::string());
  }
}

}  // namespace weightfs
