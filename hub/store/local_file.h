// Local files, one helper for every layer above core/ (core does no I/O): whole reads and
// writes that retry EINTR and short transfers, a crash-safe replace (WriteAtomically), syncs,
// and the one place a failed system call's errno is read into a Status (LastErrnoStatus;
// fs/status_errno.h turns it back into the errno of a reply). A full disk or quota (ENOSPC,
// EDQUOT) is ResourceExhausted, a missing file NotFound, every other failure IOError; the
// message says what was being done and strerror.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/status.h"

namespace weightfs {

// The Status of the system call that just failed (reads errno; StatusOfErrno, core/status.h).
Status LastErrnoStatus(std::string_view what);

// How WriteAtomically writes: the file's permission bits, and whether the new content must be
// on disk when it returns (fsync the file and its directory). Not durable: a reader never sees
// a torn file, but a crash may leave the old content (a metrics file rewritten every interval).
struct AtomicWrite {
  mode_t mode = 0600;
  bool durable = true;
};
// Writes `bytes` to `path` so that a reader (and a crash) sees the old or the new content, never
// a mix: write `path`.tmp, fsync, rename, fsync the directory. One writer per path at a time.
Status WriteAtomically(const std::string& path, std::string_view bytes, AtomicWrite how = {});
Expected<std::string> ReadWholeFile(const std::string& path);

// Writes all n bytes at `off` (retrying short writes and EINTR). `what` names the file for the
// message.
Status PwriteAll(int fd, const uint8_t* p, size_t n, uint64_t off, std::string_view what);
// Reads up to n bytes; short only at the end of the file (the rest is left zero).
Status PreadAll(int fd, uint8_t* p, size_t n, uint64_t off, std::string_view what);
// Reads up to `size` bytes at `offset` (retrying short reads and EINTR); returns how many it
// read: fewer at the end of the file, or on an error (its errno in *error, else 0).
uint64_t PreadUpTo(int fd, uint8_t* out, uint64_t size, uint64_t offset, int* error = nullptr);
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
