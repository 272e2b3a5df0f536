// POSIX shims of the drafts: the one place in fs/drafts/ where a failed system call's errno is
// read, and turned into a Status (fs/status_errno.h turns it back into the errno of a reply).
// A full disk or quota (ENOSPC, EDQUOT) is ResourceExhausted, a missing file NotFound, every
// other failure IOError; the message says what was being done and strerror.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/status.h"

namespace weightfs {

// The Status of the system call that just failed (reads errno; StatusOfErrno, core/status.h).
Status LastErrnoStatus(std::string_view what);

// Writes `bytes` to `path` so that a crash leaves the old or the new content (write a
// temporary, fsync, rename, fsync the directory).
Status WriteAtomically(const std::string& path, std::string_view bytes);
Expected<std::string> ReadWholeFile(const std::string& path);

// Writes all n bytes at `off` (retrying short writes and EINTR). `what` names the file for the
// message.
Status PwriteAll(int fd, const uint8_t* p, size_t n, uint64_t off, std::string_view what);
// Reads up to n bytes; short only at the end of the file (the rest is left zero).
Status PreadAll(int fd, uint8_t* p, size_t n, uint64_t off, std::string_view what);
// syncfs of the file system holding `path`: every file written there is on disk (one sync for
// many files, where an fdatasync each would cost a disk flush each).
Status SyncFileSystemOf(const std::string& path);
// fdatasync(fd), as a Status.
Status DataSync(int fd, std::string_view what);
// Starts writing the file's dirty pages to disk and returns (sync_file_range WRITE; best
// effort): a DataSync later then waits for less.
void StartWriteback(int fd);
// Copies the first `size` bytes of `from` into `to` (copy_file_range, or read and write where
// the file system cannot), then sets `to`'s length to `size`.
Status CopyPrefix(int from, int to, uint64_t size, std::string_view what);

}  // namespace weightfs
