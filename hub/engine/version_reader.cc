#include "hub/engine/version_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <optional>

#include "core/hash.h"

namespace weightfs {
namespace {

Status WriteAll(int fd, std::span<const uint8_t> bytes, uint64_t offset, const std::string& path) {
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::pwrite(fd, bytes.data() + done, bytes.size() - done,
                         static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      std::string m = "writing " + path + ": " + std::strerror(errno);
      return errno == ENOSPC ? Status::ResourceExhausted(m) : Status::IOError(m);
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

}  // namespace

Status ForEachChunk(Materializer& materializer, ThreadPool& pool, const Manifest& manifest,
                    const ManifestFile& head_file,
                    const std::function<Status(size_t, std::span<const uint8_t>)>& consume) {
  WFS_ASSIGN_OR_RETURN(std::shared_ptr<const ManifestFile> rows, materializer.bucket()->File(manifest, head_file));
  const ManifestFile& file = *rows;
  const size_t window = std::max<size_t>(2, pool.size() * 2);
  std::vector<std::optional<Expected<ByteBuffer>>> results(window);
  for (size_t start = 0; start < file.chunks.size(); start += window) {
    const size_t n = std::min(window, file.chunks.size() - start);
    pool.ParallelFor(n, [&](size_t i, size_t) {
      results[i].emplace(materializer.Chunk(manifest, file, start + i));
    });
    for (size_t i = 0; i < n; ++i) {
      Expected<ByteBuffer>& r = *results[i];
      if (!r.ok()) return r.status();
      WFS_TRY(consume(start + i, *r));
      results[i].reset();
    }
  }
  return Status::Ok();
}

Status PullVersion(Materializer& materializer, ThreadPool& pool, const Manifest& manifest,
                   const std::string& dest_dir, const ReadOptions& options) {
  uint64_t total = manifest.stats.logical_bytes, done = 0;
  for (const ManifestFile& head_file : manifest.files) {
    WFS_ASSIGN_OR_RETURN(std::shared_ptr<const ManifestFile> rows, materializer.bucket()->File(manifest, head_file));
    const ManifestFile& file = *rows;
    const std::string final_path = dest_dir + "/" + file.path;
    const std::string partial = final_path + ".weightfs-partial";
    std::error_code ec;
    std::filesystem::create_directories(std::filesystem::path(final_path).parent_path(), ec);
    if (ec) return Status::IOError("creating the directory of " + final_path + ": " + ec.message());
    int fd = ::open(partial.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return StatusOfErrno(errno, "creating " + partial);
    Sha256 sha;
    Status s = ForEachChunk(materializer, pool, manifest, file,
                            [&](size_t i, std::span<const uint8_t> bytes) -> Status {
                              WFS_TRY(WriteAll(fd, bytes, file.chunks[i].offset, partial));
                              sha.Update(bytes);
                              done += bytes.size();
                              if (options.progress) options.progress(done, total);
                              return Status::Ok();
                            });
    if (s.ok() && ::fsync(fd) != 0) s = StatusOfErrno(errno, "fsync " + partial);
    ::close(fd);
    if (s.ok()) {
      std::string got = sha.FinishHex();
      if (!file.sha256.empty() && got != file.sha256) {  // empty: unknown (derived versions)
        s = Status::Corruption(manifest.model + "@" + manifest.version + " " + file.path +
                               ": SHA-256 " + got + " does not match the manifest's " + file.sha256);
      }
    }
    if (!s.ok()) {
      ::unlink(partial.c_str());
      return s;
    }
    if (::rename(partial.c_str(), final_path.c_str()) != 0) {
      return StatusOfErrno(errno, "renaming " + partial);
    }
    if (options.cache) {
      // The pulled file now holds every chunk: remember where, so that pulling the next version
      // finds its bases here without a second copy in the cache (one index file for the file).
      std::error_code abs_ec;
      const std::string abs = std::filesystem::absolute(final_path, abs_ec).string();
      std::vector<ChunkRef> refs;
      refs.reserve(file.chunks.size());
      for (const ManifestChunk& c : file.chunks) refs.push_back({c.hash, c.offset, c.length});
      (void)options.cache->PutReferences(abs, refs);
    }
  }
  return Status::Ok();
}

Status VerifyVersion(Materializer& materializer, ThreadPool& pool, const Manifest& manifest,
                     const ReadOptions& options) {
  uint64_t total = manifest.stats.logical_bytes, done = 0;
  for (const ManifestFile& file : manifest.files) {
    Sha256 sha;
    WFS_TRY(ForEachChunk(materializer, pool, manifest, file,
                         [&](size_t, std::span<const uint8_t> bytes) -> Status {
                           sha.Update(bytes);
                           done += bytes.size();
                           if (options.progress) options.progress(done, total);
                           return Status::Ok();
                         }));
    std::string got = sha.FinishHex();
    if (!file.sha256.empty() && got != file.sha256) {  // empty: unknown (derived versions)
      return Status::Corruption(manifest.model + "@" + manifest.version + " " + file.path +
                                ": SHA-256 " + got + " does not match the manifest's " + file.sha256);
    }
  }
  return Status::Ok();
}

Status ReadRange(Materializer& materializer, const Manifest& manifest, const ManifestFile& head_file,
                 uint64_t offset, uint64_t length,
                 const std::function<Status(std::span<const uint8_t>)>& sink) {
  WFS_ASSIGN_OR_RETURN(std::shared_ptr<const ManifestFile> rows, materializer.bucket()->File(manifest, head_file));
  const ManifestFile& file = *rows;
  if (offset >= file.size) return Status::Ok();
  const uint64_t end = offset + std::min(length, file.size - offset);
  for (size_t i = file.ChunkAt(offset); i < file.chunks.size() && file.chunks[i].offset < end; ++i) {
    const ManifestChunk& c = file.chunks[i];
    WFS_ASSIGN_OR_RETURN(ByteBuffer bytes, materializer.Chunk(manifest, file, i));
    const uint64_t from = std::max(offset, c.offset) - c.offset;
    const uint64_t to = std::min(end, c.offset + c.length) - c.offset;
    WFS_TRY(sink(std::span<const uint8_t>(bytes).subspan(from, to - from)));
  }
  return Status::Ok();
}

}  // namespace weightfs
