// Status and Expected<T>: the result types of everything in core/ and the layers above that can fail.
//
// A Status is a kind plus a message with context ("tensor 'wte': offsets [0, 10) overlap ...").
// Expected<T> holds either a T or a non-OK Status. Neither throws; callers test ok() and
// propagate with WFS_TRY / WFS_ASSIGN_OR_RETURN. Both are value types, safe to copy and move;
// like any value they are not synchronized.
#pragma once

#include <cassert>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace weightfs {

enum class ErrorKind {
  kOk = 0,
  kNotFound,
  kCorruption,       // bytes from outside failed validation (payload, header, manifest)
  kInvalidArgument,  // the caller asked for something impossible
  kIOError,
  kConflict,         // create-if-absent lost a race
  kTimeout,
  kAuth,
  kResourceExhausted,  // a hard cap (decompression bomb, memory/disk budget) was hit
  kUnsupported,
  // What a file system request can be refused for (fs/status_errno.h maps each to its errno).
  kNotEmpty,          // a directory that must be empty is not
  kIsDirectory,       // a file operation on a directory
  kNotDirectory,      // a directory operation on a file
  kBusy,              // the node is in use (open for writing, being published)
  kPermissionDenied,  // not allowed on this kind of node, whoever asks
  kReadOnly,          // the node cannot change (a published version, drafts off)
  kCrossDevice,       // a rename between places that cannot hold each other's nodes
  kStale,             // the node was replaced (a draft published under its name)
  kNameTooLong,
  kBadHandle,         // the open file does not allow the operation (a write through O_RDONLY)
  kNoAttribute,       // no such extended attribute
  kOutOfRange,        // a buffer too small for the answer
};

std::string_view ErrorKindName(ErrorKind kind);

class Status;
// The Status of a system call that failed with errno `err` while doing `what`: a full disk or
// quota (ENOSPC, EDQUOT) is ResourceExhausted, a missing file (ENOENT) NotFound, anything else
// IOError; the message is "<what>: <strerror>". (A caller that gives more errnos a meaning of
// their own, as LocalStore does, checks those first.)
Status StatusOfErrno(int err, std::string_view what);
// The Status of the exception being handled, for the places where none may escape (thread
// entry points, callbacks from C): ResourceExhausted for std::bad_alloc, IOError with what()
// for another std::exception, IOError for anything else; the message starts with `context`.
// Never throws (an allocation failing here gives a message without the context).
// REQUIRES: called inside a catch block.
Status StatusOfCurrentException(std::string_view context) noexcept;

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(ErrorKind kind, std::string message) : kind_(kind), message_(std::move(message)) {}

  static Status Ok() { return {}; }
  static Status NotFound(std::string m) { return {ErrorKind::kNotFound, std::move(m)}; }
  static Status Corruption(std::string m) { return {ErrorKind::kCorruption, std::move(m)}; }
  static Status InvalidArgument(std::string m) {
    return {ErrorKind::kInvalidArgument, std::move(m)};
  }
  static Status IOError(std::string m) { return {ErrorKind::kIOError, std::move(m)}; }
  static Status Conflict(std::string m) { return {ErrorKind::kConflict, std::move(m)}; }
  static Status Timeout(std::string m) { return {ErrorKind::kTimeout, std::move(m)}; }
  static Status Auth(std::string m) { return {ErrorKind::kAuth, std::move(m)}; }
  static Status ResourceExhausted(std::string m) {
    return {ErrorKind::kResourceExhausted, std::move(m)};
  }
  static Status Unsupported(std::string m) { return {ErrorKind::kUnsupported, std::move(m)}; }
  static Status NotEmpty(std::string m) { return {ErrorKind::kNotEmpty, std::move(m)}; }
  static Status IsDirectory(std::string m) { return {ErrorKind::kIsDirectory, std::move(m)}; }
  static Status NotDirectory(std::string m) { return {ErrorKind::kNotDirectory, std::move(m)}; }
  static Status Busy(std::string m) { return {ErrorKind::kBusy, std::move(m)}; }
  static Status PermissionDenied(std::string m) { return {ErrorKind::kPermissionDenied, std::move(m)}; }
  static Status ReadOnly(std::string m) { return {ErrorKind::kReadOnly, std::move(m)}; }
  static Status CrossDevice(std::string m) { return {ErrorKind::kCrossDevice, std::move(m)}; }
  static Status Stale(std::string m) { return {ErrorKind::kStale, std::move(m)}; }
  static Status NameTooLong(std::string m) { return {ErrorKind::kNameTooLong, std::move(m)}; }
  static Status BadHandle(std::string m) { return {ErrorKind::kBadHandle, std::move(m)}; }
  static Status NoAttribute(std::string m) { return {ErrorKind::kNoAttribute, std::move(m)}; }
  static Status OutOfRange(std::string m) { return {ErrorKind::kOutOfRange, std::move(m)}; }

  bool ok() const { return kind_ == ErrorKind::kOk; }
  ErrorKind kind() const { return kind_; }
  const std::string& message() const { return message_; }
  // "Corruption: <message>"
  std::string ToString() const;

  // Returns a copy whose message is prefixed with `context + ": "`.
  Status WithContext(std::string_view context) const;

 private:
  ErrorKind kind_ = ErrorKind::kOk;
  std::string message_;
};

template <typename T>
class [[nodiscard]] Expected {
 public:
  Expected(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Expected(Status status) : v_(std::move(status)) {  // NOLINT
    assert(!std::get<Status>(v_).ok() && "Expected built from an OK status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return ok(); }

  // REQUIRES: ok()
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

  // OK status when ok().
  Status status() const { return ok() ? Status::Ok() : std::get<Status>(v_); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace weightfs

#define WFS_CONCAT_INNER(a, b) a##b
#define WFS_CONCAT(a, b) WFS_CONCAT_INNER(a, b)

// Returns the Status of `expr` from the enclosing function if it is not OK.
#define WFS_TRY(expr)                                     \
  do {                                                    \
    ::weightfs::Status wfs_try_status_ = (expr);          \
    if (!wfs_try_status_.ok()) return wfs_try_status_;    \
  } while (0)

// `lhs = value of expr`, or return its Status from the enclosing function.
#define WFS_ASSIGN_OR_RETURN(lhs, expr) \
  WFS_ASSIGN_OR_RETURN_IMPL(WFS_CONCAT(wfs_expected_, __LINE__), lhs, expr)
#define WFS_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()
