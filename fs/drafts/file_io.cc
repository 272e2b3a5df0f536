// Open files of a draft: create, open, setattr (truncate, chmod, times), read, write, fsync,
// release (the last writer's close queues the encode).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include <spdlog/spdlog.h>

#include "hub/store/local_file.h"
#include "fs/drafts/state.h"

namespace weightfs {

namespace {
bool Writes(int flags) { return (flags & O_ACCMODE) != O_RDONLY || (flags & O_TRUNC); }
}  // namespace

Status Drafts::Create(uint64_t parent, std::string_view name, mode_t mode, int flags, const Caller& who,
                   NodeAttr* out, std::unique_ptr<DraftHandle>* handle) {
  State& s = *state_;
  if (DirPath(parent)) return Status::PermissionDenied("files live in versions");
  std::shared_ptr<Draft> d;
  uint64_t ino;
  bool created = false;
  {
    MutexLock lock(s.mu);
    std::string dir;
    WFS_TRY(s.DirOfLocked(parent, &d, &dir));
    const std::string path = Join(dir, name);
    if (Status v = ValidateFilePath(path); !v.ok()) {
      spdlog::warn("create {}/{}: {}", d->name(), path, v.message());
      return Status::InvalidArgument(path + ": " + v.message());
    }
    if (d->dirs.count(path)) return Status::IsDirectory("is a directory");
    if (d->committing) return Status::Busy("the draft is being committed");
    ino = s.InoLocked(State::Type::kItem, d->name(), path);
    if (!d->files.count(path)) {
      auto f = std::make_shared<DraftFile>(NodeMeta::At(mode, who.uid, who.gid, NowNs()));
      MutexLock flock(f->mu);
      WFS_TRY(s.StageLocked(*d, *f, false));
      f->path = path;
      d->files[path] = f;
      d->Changed(path);
      d->TouchDir(dir);
      created = true;
    } else if (flags & O_EXCL) {
      return Status::Conflict(path + " exists already (O_EXCL)");
    }
  }
  // The new file is in the journal before the kernel learns of it: a crash cannot lose it.
  if (created) WFS_TRY(s.SaveJournal(*d));
  WFS_TRY(Open(ino, flags | O_CREAT, handle));
  return GetAttr(ino, out);
}

Status Drafts::Open(uint64_t ino, int flags, std::unique_ptr<DraftHandle>* handle) {
  State& s = *state_;
  auto h = std::make_unique<DraftHandle>();
  bool journal = false;
  std::string unlink_after;  // a staging file replaced by a new one (see ResizeLocked)
  {
    MutexLock lock(s.mu);
    const State::Ref* r = s.RefLocked(ino);
    if (!r || r->type != State::Type::kItem) return Status::IsDirectory("is a directory");
    std::shared_ptr<Draft> d = s.DraftLocked(r->a);
    if (!d) return s.GoneLocked(r->a);
    auto it = d->files.find(r->b);
    if (it == d->files.end()) {
      return d->dirs.count(r->b) ? Status::IsDirectory(r->b + " is a directory")
                                 : Status::NotFound(r->b + ": no such file");
    }
    h->draft = d;
    h->file = it->second;
    h->path = r->b;
    DraftFile& f = *h->file;
    MutexLock flock(f.mu);
    if (Writes(flags)) {
      if (d->committing) return Status::Busy("the draft is being committed");
      if (f.id == 0) {
        WFS_TRY(s.StageLocked(*d, f, !(flags & O_TRUNC)));
        journal = true;
      } else if (flags & O_TRUNC) {
        WFS_TRY(s.ResizeLocked(*d, f, 0, d->next_id, &unlink_after));
        if (!unlink_after.empty()) {
          d->next_id++;
          journal = true;
        }
        f.backed = false;
        f.present.clear();
        if (!f.write_error.empty()) journal = true;
        f.write_error.clear();
      }
      if (!f.encoded.empty()) journal = true;  // the encoded part is stale from now on
      f.writers++;
      f.generation++;
      if (flags & O_TRUNC) f.meta.Touch(NowNs());
      h->write = true;
    }
    // The descriptor is open while a handle is: an unlink of the path leaves it readable.
    if (Status st = f.EnsureFd(); !st.ok()) {
      if (h->write) f.writers--;
      return st;
    }
    // A checkpoint saved by cp or torch.save: write-only, nothing else has the file open. Its
    // writes then reach the daemon from the writer's pages, not copied into cached pages of
    // the file first (a 2 GB save by cp: 8-9 s -> 5 s on the 2-core VM). A write-only handle
    // cannot be mapped, so no mmap is lost.
    if ((flags & O_ACCMODE) == O_WRONLY && f.handles == 0) {
      h->direct = h->direct_writer = true;
      f.direct_writers++;
    } else if (f.direct_writers > 0) {
      h->direct = true;
    }
    f.handles++;
    if (journal) d->Changed(r->b);
  }
  if (journal && !s.SaveJournal(*h->draft).ok()) {
    MutexLock flock(h->file->mu);
    if (h->write) h->file->writers--;
    if (h->direct_writer) h->file->direct_writers--;
    h->file->handles--;
    h->file->CloseIdleFd();
    return Status::IOError("cannot record the open in the draft's journal");
  }
  if (!unlink_after.empty()) ::unlink(unlink_after.c_str());
  *handle = std::move(h);
  return Status::Ok();
}

Status Drafts::SetAttr(uint64_t ino, const AttrChange& change, DraftHandle* handle, NodeAttr* out) {
  State& s = *state_;
  std::shared_ptr<Draft> d;
  std::shared_ptr<DraftFile> f;
  std::string path;
  uint64_t spare_id = 0;
  std::string unlink_after;  // a staging file replaced by a new one (see ResizeLocked)
  const std::optional<uint64_t>& size = change.size;
  const int64_t now = NowNs();
  // Owner, mode and times (the kernel checked the caller may change them: default_permissions).
  auto apply = [&](NodeMeta& m) {
    if (change.mode) m.mode = *change.mode & 07777;
    if (change.uid) m.uid = *change.uid;
    if (change.gid) m.gid = *change.gid;
    if (change.atime_ns) m.atime_ns = *change.atime_ns;
    if (change.mtime_ns) m.mtime_ns = *change.mtime_ns;
    m.ctime_ns = now;
  };
  {
    MutexLock lock(s.mu);
    const State::Ref* r = s.RefLocked(ino);
    if (handle) {
      // ftruncate, fchmod...: the open file, even if it was renamed or unlinked since.
      d = handle->draft;
      f = handle->file;
      if (s.DraftLocked(d->name()) != d) return s.GoneLocked(d->name());
      path = f->path;
    } else {
      if (!r) return Status::NotFound("no such file or directory");
      // The directories above the versions are the mount's, not a draft's: nothing to keep
      // their owner or times in.
      if (r->type == State::Type::kNewDir) {
        return size ? Status::IsDirectory("a directory above the versions")
                    : Status::PermissionDenied("a directory above the versions belongs to the mount");
      }
      d = s.DraftLocked(r->a);
      if (!d) return s.GoneLocked(r->a);
    }
    if (!f && (r->type == State::Type::kDraftDir || d->dirs.count(r->b))) {
      if (size) return Status::IsDirectory("is a directory");
      apply(*d->DirMeta(r->type == State::Type::kDraftDir ? std::string() : r->b));
      if (r->type != State::Type::kDraftDir) d->Changed(r->b);
    } else {
      if (!f) {
        auto it = d->files.find(r->b);
        if (it == d->files.end()) return Status::NotFound("no such file or directory");
        f = it->second;
        path = r->b;
      }
      MutexLock flock(f->mu);
      if (size && f->id == 0) {
        if (d->committing) return Status::Busy("the draft is being committed");
        WFS_TRY(s.StageLocked(*d, *f, true));
      }
      if (size) spare_id = d->next_id++;  // in case the file must move (ResizeLocked)
      apply(f->meta);
      if (!path.empty()) d->Changed(path);
    }
  }
  if (size) {
    bool backed;
    {
      MutexLock flock(f->mu);
      backed = f->backed && *size < f->backing_limit;
    }
    if (backed) {
      WFS_TRY(ParentBytes(s.EnsureRows(*d, *f), "truncate " + d->name() + "/" + path));
    }
    // The chunk the new end cuts through keeps its head: copy it up first.
    std::optional<size_t> cut;
    {
      MutexLock flock(f->mu);
      if (f->backed && *size < f->backing_limit) {
        const size_t c = f->rows->ChunkAt(*size);
        if (f->present[c] == ChunkState::kParent && f->rows->chunks[c].offset < *size) cut = c;
      }
    }
    if (cut) {
      Expected<std::shared_ptr<const ByteBuffer>> bytes = s.reader->Chunk(d->parent_manifest, *f->rows, *cut);
      if (!bytes.ok()) return ParentBytes(bytes.status(), "truncate " + d->name() + "/" + path);
      MutexLock flock(f->mu);
      const ManifestChunk& c = f->rows->chunks[*cut];
      if (f->StillBackedAt(*cut)) {
        WFS_TRY(f->EnsureFd());
        WFS_TRY(PwriteAll(f->fd, (*bytes)->data(),
                          std::min<uint64_t>({c.length, *size - c.offset, f->backing_limit - c.offset}), c.offset,
                          "staging file " + f->staging));
        f->present[*cut] = ChunkState::kCopiedUp;
      }
    }
    MutexLock flock(f->mu);
    Status resized = s.ResizeLocked(*d, *f, *size, spare_id, &unlink_after);
    f->CloseIdleFd();  // (a truncate by path opened it)
    WFS_TRY(resized);
    if (*size == 0) f->write_error.clear();
    if (f->backed) f->backing_limit = std::min(f->backing_limit, *size);
    f->generation++;
    if (!change.mtime_ns) f->meta.mtime_ns = now;
    if (f->writers == 0 && !path.empty()) s.Enqueue(d->name(), path);
  }
  WFS_TRY(s.SaveJournal(*d));
  if (!unlink_after.empty()) ::unlink(unlink_after.c_str());
  if (f && path.empty()) {  // an open file that is unlinked: its attributes from the handle
    MutexLock lock(s.mu);
    s.FileAttr(ino, *f, out);
    out->st.st_nlink = 0;
    return Status::Ok();
  }
  return GetAttr(ino, out);
}

Status Drafts::Read(DraftHandle& h, uint64_t offset, size_t size, std::vector<uint8_t>* out) {
  State& s = *state_;
  DraftFile& f = *h.file;
  bool needs_rows;
  {
    MutexLock lock(f.mu);
    needs_rows = f.id == 0 || f.backed;  // reads (some of) the parent's bytes
  }
  if (needs_rows) {
    WFS_TRY(ParentBytes(s.EnsureRows(*h.draft, f), "read " + h.draft->name() + "/" + h.path));
  }
  uint64_t id, fsize, limit = 0;
  bool backed;
  // The states of the parent chunks the read covers, from chunk first_chunk on (a copy: the lock
  // is not held while reading; not the whole map, which has a state per chunk of the file).
  std::vector<ChunkState> present;
  size_t first_chunk = 0;
  {
    MutexLock lock(f.mu);
    id = f.id;
    fsize = f.id == 0 ? f.parent_file->size : f.size;
    backed = f.backed;
    if (backed) {
      limit = f.backing_limit;
      const uint64_t until = std::min({limit, fsize, offset + size});
      if (offset < until) {
        first_chunk = f.rows->ChunkAt(offset);
        present.assign(f.present.begin() + static_cast<std::ptrdiff_t>(first_chunk),
                       f.present.begin() + static_cast<std::ptrdiff_t>(f.rows->ChunkAt(until - 1) + 1));
      }
    }
  }
  // Under the file's lock: a truncate may move the file to a new staging file (ResizeLocked)
  // and close the descriptor.
  auto pread_staged = [&f](uint8_t* p, size_t n, uint64_t off) {
    MutexLock lock(f.mu);
    WFS_TRY(f.EnsureFd());
    return PreadAll(f.fd, p, n, off, "staging file " + f.staging);
  };
  out->clear();
  if (offset >= fsize) return Status::Ok();
  const uint64_t end = std::min<uint64_t>(fsize, offset + size);
  if (id == 0) {
    Expected<ReadResult> r = s.reader->Read(h.draft->parent_manifest, f.rows_holder, offset, end - offset, &h.stream);
    if (!r.ok()) return ParentBytes(r.status(), "read " + h.draft->name() + "/" + h.path);
    out->reserve(r->size);
    for (const iovec& v : r->iov) {
      out->insert(out->end(), static_cast<const uint8_t*>(v.iov_base), static_cast<const uint8_t*>(v.iov_base) + v.iov_len);
    }
    return Status::Ok();
  }
  out->resize(end - offset);
  uint64_t pos = offset;
  while (pos < end) {
    if (backed && pos < limit) {
      const size_t c = f.rows->ChunkAt(pos);
      const ManifestChunk& ch = f.rows->chunks[c];
      const uint64_t cend = std::min({ch.offset + ch.length, limit, end});
      if (present[c - first_chunk] == ChunkState::kParent) {
        Expected<std::shared_ptr<const ByteBuffer>> bytes = s.reader->Chunk(h.draft->parent_manifest, *f.rows, c);
        if (!bytes.ok()) return ParentBytes(bytes.status(), "read " + h.draft->name() + "/" + h.path);
        std::memcpy(out->data() + (pos - offset), (*bytes)->data() + (pos - ch.offset), cend - pos);
      } else {
        WFS_TRY(pread_staged(out->data() + (pos - offset), cend - pos, pos));
      }
      pos = cend;
      continue;
    }
    WFS_TRY(pread_staged(out->data() + (pos - offset), end - pos, pos));
    pos = end;
  }
  return Status::Ok();
}

Status Drafts::Write(DraftHandle& h, uint64_t offset, std::span<const uint8_t> data) {
  State& s = *state_;
  DraftFile& f = *h.file;
  if (!h.write) return Status::BadHandle("not open for writing");
  bool backed;
  {
    MutexLock lock(f.mu);
    backed = f.backed;
  }
  // Only a file still backed by its parent needs the parent's rows (a write to a file opened
  // with O_TRUNC must not depend on the bucket).
  if (backed) {
    WFS_TRY(ParentBytes(s.EnsureRows(*h.draft, f), "copy-up of " + h.draft->name() + "/" + h.path));
  }
  const uint64_t end = offset + data.size();
  // Copy-up: parent chunks this write covers only in part are materialized first (and made
  // durable: the journal will say they are in the staging file).
  bool copied = false;
  for (;;) {
    std::optional<size_t> need;
    {
      MutexLock lock(f.mu);
      if (f.backed && offset < f.backing_limit) {
        for (size_t c = f.rows->ChunkAt(offset); c < f.present.size(); ++c) {
          const ManifestChunk& ch = f.rows->chunks[c];
          if (ch.offset >= end || ch.offset >= f.backing_limit) break;
          if (f.present[c] != ChunkState::kParent) continue;
          const uint64_t cend = std::min(ch.offset + ch.length, f.backing_limit);
          if (offset <= ch.offset && end >= cend) continue;  // wholly overwritten: nothing to copy
          need = c;
          break;
        }
      }
    }
    if (!need) break;
    Expected<std::shared_ptr<const ByteBuffer>> bytes = s.reader->Chunk(h.draft->parent_manifest, *f.rows, *need);
    if (!bytes.ok()) return ParentBytes(bytes.status(), "copy-up of " + h.draft->name() + "/" + h.path);
    MutexLock lock(f.mu);
    if (f.StillBackedAt(*need)) {
      WFS_TRY(f.EnsureFd());
      const ManifestChunk& ch = f.rows->chunks[*need];
      const uint64_t len = std::min<uint64_t>(ch.length, f.backing_limit - ch.offset);
      WFS_TRY(PwriteAll(f.fd, (*bytes)->data(), len, ch.offset, "staging file " + f.staging));
      f.present[*need] = ChunkState::kCopiedUp;
      copied = true;
    }
  }
  bool marked = copied;  // the copy-up map changed: journaled before the write is acknowledged
  {
    MutexLock lock(f.mu);
    WFS_TRY(f.EnsureFd());
    if (Status st = PwriteAll(f.fd, data.data(), data.size(), offset, "staging file " + f.staging); !st.ok()) {
      spdlog::error("write {}/{} at {}: {}; the draft cannot be committed until the file is written again or "
                    "removed", h.draft->name(), h.path, offset, st.message());
      f.write_error = st.message();
      f.journal_dirty = true;
      return st;
    }
    // A save's bytes go on to the disk as they come, and leave the page cache behind them.
    if (h.direct) f.streamed.Wrote(f.fd, offset, end);
    // Parent chunks this write covered whole are the staging file's from now on (marked only
    // once the bytes are there: a reader or a crash before sees the parent's).
    if (f.backed && offset < f.backing_limit) {
      for (size_t c = f.rows->ChunkAt(offset); c < f.present.size(); ++c) {
        const ManifestChunk& ch = f.rows->chunks[c];
        if (ch.offset >= end || ch.offset >= f.backing_limit) break;
        if (f.present[c] == ChunkState::kParent && offset <= ch.offset && end >= std::min(ch.offset + ch.length, f.backing_limit)) {
          f.present[c] = ChunkState::kOverwritten;
          marked = true;
        }
      }
    }
    f.size = std::max(f.size, end);
    f.generation++;
    f.meta.Touch(NowNs());
    f.journal_dirty = true;  // (the times; written at the next fsync or close)
    if (copied) WFS_TRY(DataSync(f.fd, f.staging));
  }
  // A journal that said "the parent's" for a chunk the staging file now holds would, after a
  // crash of the daemon, show the parent's bytes where this write put its own.
  if (marked) {
    if (Status js = s.SaveJournal(*h.draft, {.file = &f}); !js.ok()) {
      MutexLock lock(f.mu);
      f.write_error = "cannot record the write in the draft's journal: " + js.message();
      return js;
    }
  }
  return Status::Ok();
}

Status Drafts::Fsync(DraftHandle& h) {
  {
    MutexLock lock(h.file->mu);
    if (h.file->id == 0) return Status::Ok();
    WFS_TRY(h.file->EnsureFd());
    WFS_TRY(DataSync(h.file->fd, h.file->staging));
  }
  // The file's entry (its times; its creation, still in the page cache) is on disk too.
  return state_->SaveJournal(*h.draft, {.file = h.file.get(), .sync = true});
}

void Drafts::Release(std::unique_ptr<DraftHandle> h) {
  if (!h->write) {
    MutexLock flock(h->file->mu);
    h->file->handles--;
    h->file->CloseIdleFd();
    return;
  }
  bool last, dirty;
  {
    MutexLock lock(state_->mu);
    MutexLock flock(h->file->mu);
    last = --h->file->writers == 0;
    dirty = h->file->journal_dirty;
    if (h->direct_writer) h->file->direct_writers--;
    h->file->handles--;
    h->file->CloseIdleFd();
  }
  state_->encoded_cv.NotifyAll();
  if (dirty) (void)state_->SaveJournal(*h->draft, {.file = h->file.get()});
  if (!last) return;
  // Encode under the file's path as it is now (it may have been renamed while open).
  std::string path;
  {
    MutexLock lock(state_->mu);
    if (state_->DraftLocked(h->draft->name()) == h->draft) path = h->file->path;
  }
  if (!path.empty()) state_->Enqueue(h->draft->name(), path);
}

}  // namespace weightfs
