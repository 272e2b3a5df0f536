// Staging files (a draft's files on local disk) and lazy copy-up: a file opened for writing
// without O_TRUNC is backed by the parent's file, chunk by chunk, until it is encoded.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>

#include <spdlog/spdlog.h>

#include "hub/store/local_file.h"
#include "fs/drafts/state.h"

namespace weightfs {

// REQUIRES mu and f.mu.
Status Drafts::State::StageLocked(Draft& d, DraftFile& f, bool backed) {
  f.id = d.next_id++;
  f.staging = d.StagingPath(f.id);
  f.streamed.Reset();
  f.fd = ::open(f.staging.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (f.fd < 0) {
    Status st = LastErrnoStatus("draft " + d.name() + ": cannot create staging file " + f.staging);
    spdlog::error("{}", st.message());
    f.id = 0;
    return st;
  }
  f.size = 0;
  f.backed = false;
  if (backed && f.parent_file) {
    if (::ftruncate(f.fd, static_cast<off_t>(f.parent_file->size)) != 0) {
      return LastErrnoStatus("sizing staging file " + f.staging);
    }
    f.size = f.parent_file->size;
    f.backed = true;
    f.present.assign(f.parent_file->RowCount(), ChunkState::kParent);
    f.backing_limit = f.parent_file->size;
  }
  return Status::Ok();
}

// Sets a staged file's length to `size`. A file that an encode is reading must not shrink
// in place (the encoder would find it cut short): it moves to a new staging file,
// numbered `spare_id` (allocated by the caller under mu), holding the bytes that stay; the
// encoder's descriptor keeps the old one until it closes it. The old file's path is returned in
// *unlink_after: the caller removes it once the journal names the new one (a crash before
// leaves the old, consistent state). REQUIRES f.mu.
Status Drafts::State::ResizeLocked(Draft& d, DraftFile& f, uint64_t size, uint64_t spare_id, std::string* unlink_after) {
  WFS_TRY(f.EnsureFd());
  if (f.readers == 0 || size >= f.size) {
    if (::ftruncate(f.fd, static_cast<off_t>(size)) != 0) return LastErrnoStatus("resizing " + f.staging);
    f.size = size;
    return Status::Ok();
  }
  const std::string path = d.StagingPath(spare_id);
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return LastErrnoStatus("cannot create staging file " + path);
  if (Status st = CopyPrefix(f.fd, fd, size, f.staging + " to " + path); !st.ok()) {
    ::close(fd);
    ::unlink(path.c_str());
    return st;
  }
  spdlog::debug("draft {}: staging file {} shrinks while it is encoded; moved to {}", d.name(), f.staging, path);
  unlink_after->assign(f.staging);
  ::close(f.fd);
  f.fd = fd;
  f.streamed.Reset();
  f.staging = path;
  f.id = spare_id;
  f.size = size;
  return Status::Ok();
}

// Loads the rows of f's parent file (once). REQUIRES no lock held (it may read the bucket).
Status Drafts::State::EnsureRows(Draft& d, DraftFile& f) {
  const ManifestFile* head;
  {
    MutexLock lock(f.mu);
    if (f.rows || !f.parent_file) return Status::Ok();
    head = f.parent_file;
  }
  Expected<std::shared_ptr<const ManifestFile>> rows = bucket->File(d.parent_manifest, *head);
  if (!rows.ok()) return rows.status().WithContext("reading the rows of " + head->path + " in the parent");
  MutexLock lock(f.mu);
  if (!f.rows) {
    f.rows_holder = std::move(rows).value();
    f.rows = f.rows_holder.get();
  }
  return Status::Ok();
}

// Copies up every parent chunk a backed file has not copied yet (before it is encoded: its
// SHA-256 needs every byte); the file is then no longer backed. REQUIRES no lock held.
Status Drafts::State::Fill(Draft& d, DraftFile& f) {
  WFS_TRY(EnsureRows(d, f));
  std::vector<size_t> missing;
  const ManifestFile* pf;
  {
    MutexLock lock(f.mu);
    if (!f.backed) return Status::Ok();
    pf = f.rows;
    for (size_t c = 0; c < f.present.size(); ++c) {
      if (f.present[c] == ChunkState::kParent && pf->chunks[c].offset < f.backing_limit) missing.push_back(c);
    }
  }
  for (size_t c : missing) {
    Expected<ByteBuffer> bytes = materializer->Chunk(*d.parent_manifest, *pf, c);
    if (!bytes.ok()) return bytes.status().WithContext("copying " + f.parent_path + " from the parent");
    MutexLock lock(f.mu);
    if (!f.StillBackedAt(c)) continue;
    WFS_TRY(f.EnsureFd());
    const uint64_t off = pf->chunks[c].offset;
    const uint64_t len = std::min<uint64_t>(bytes->size(), f.backing_limit - off);
    WFS_TRY(PwriteAll(f.fd, bytes->data(), len, off, "staging file " + f.staging));
    f.present[c] = ChunkState::kCopiedUp;
  }
  {
    MutexLock lock(f.mu);
    WFS_TRY(f.EnsureFd());
    Status synced = DataSync(f.fd, f.staging);
    f.CloseIdleFd();
    WFS_TRY(synced);
    f.backed = false;
    f.present.clear();
  }
  return SaveJournal(d, {.file = &f});
}

}  // namespace weightfs
