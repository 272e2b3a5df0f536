// StatusToErrno: the one place where a weightfs Status becomes the errno of a FUSE reply.
//
// The mapping depends on what the request was about: a NotFound while resolving a name is
// ENOENT, but a NotFound while fetching the bytes of a file that exists (a pack or a base
// manifest missing from the bucket) is an I/O error for the reader, EIO.
//
// The file-system kinds (NotEmpty, IsDirectory, Busy, ReadOnly, CrossDevice, Stale, ...) map
// to their errno whatever the context: the drafts, the patch view and the FUSE adapter return
// a Status, and no errno is written anywhere else in fs/ except the POSIX shims
// (hub/store/local_file.h), which turn a failed system call's errno into a Status.
//
// Every error that reaches a reader as EIO/ENOMEM is logged here, with the Status message: the
// stores' messages name the bucket key, and the Materializer's name the version, file and chunk.
// Expected refusals (ENOENT, EEXIST, ENOTEMPTY, ...) are logged at debug level. Thread-safe.
#pragma once

#include <string_view>

#include "core/status.h"

namespace weightfs {

enum class ErrnoContext {
  kName,  // lookup, getattr, readdir, readlink, getxattr: NotFound means "no such entry"
  kData,  // read: the entry exists, its bytes could not be produced
  kXattr,  // getxattr: NotFound means "no such attribute" (ENODATA)
  // A request that changes the tree or a file (mkdir, create, write, setattr, rename, ...):
  // NotFound is ENOENT, ResourceExhausted ENOSPC (the staging disk is full).
  kChange,
  // Publishing a draft (setxattr user.weightfs.commit): Conflict is EEXIST (the version exists),
  // InvalidArgument EBUSY (the draft cannot be published as it stands: files open, a parent not
  // published yet), ResourceExhausted ENOSPC (staging disk or a bucket quota).
  kCommit,
};

// Returns a positive errno for a non-OK `status` (0 for OK) and logs it. `operation` names the
// request for the log line ("read acme/qwen@v3/model.safetensors").
int StatusToErrno(const Status& status, ErrnoContext context, std::string_view operation);

}  // namespace weightfs
