// StagedVersion: one version written by several writers ("parts", one per training node), published
// once, atomically, with the bucket's create-if-absent as the only coordination (docs/parts.md).
//
// Objects, beside the versions (nothing under models/, so readers never see a staged version):
//
//   staging/<model>@<version>/intent.json    created once (create-if-absent) by the first part
//                                            to arrive: {"parts": N, "parent": "v0" | null,
//                                            "host", "created_ms"}. It fixes N and the parent
//                                            for every part.
//   staging/<model>@<version>/parts/<id>     a part record (below), put after the part's packs
//   staging/<model>@<version>/conflict       why the complete set cannot be published (text)
//
// A part record is "WFSPART1\n", one line of JSON (meta: id, parts, parent, host, pid,
// created_ms, removed paths, bytes, element tallies), "\n", then a format 1 manifest (the
// version's name, the parts' parent) holding exactly the files the part wrote. Its packs are in
// packs/ before the record exists.
//
// Publishing: a part is submitted (Submit: intent, record, then one Step), then waited for
// (Step until published). When the records in the listing number N, the version is assembled —
// the parent's files, less those any part removed, with every part's files over them — and
// published as one head with create-if-absent (Bucket::PublishManifest). The writer whose
// submission completed the set publishes at once; the others publish only if the version is
// still missing `kPublishFallback` (+ 2 s per part id that sorts before theirs) after they saw
// the set complete (the completer died), so a cluster reads the N records about once. Racing publishers are harmless: one head wins, and
// every writer checks that the published version holds its own part exactly.
//
// A part id names a writer's part for the version's life: a resubmission under the same id
// replaces the record (never counted twice). Two parts that write one path (or one writes what
// another removes): nothing is published; `conflict` says which path and which parts, and every
// part's data stays. `Discard` deletes the intent, records and conflict marker: waiting writers
// see their record gone. gc (hub/engine/gc.h) keeps the packs of staged parts until their records are
// older than its grace period.
//
// Thread-compatible (one writer's state); the bucket objects are the shared state.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/manifest.h"
#include "core/thread_pool.h"
#include "hub/engine/bucket.h"
#include "hub/engine/chunk_cache.h"
#include "hub/engine/version_writer.h"

namespace weightfs {

// What a part record says of itself (its first line).
struct PartMeta {
  std::string id;
  int parts = 0;                     // N, as the writer was told
  std::optional<std::string> parent;
  std::string host;
  int64_t pid = 0;
  int64_t created_ms = 0;
  std::vector<std::string> removed;  // parent files this part removed (and did not write)
  size_t files = 0;                  // files it wrote
  uint64_t logical_bytes = 0, stored_bytes = 0;
  // Tensor elements, tensor elements changed, other bytes, other bytes changed (PushResult's).
  std::array<uint64_t, 4> tally{};
};

struct PartRecord {
  PartMeta meta;
  Manifest manifest;  // format 1, the version's name, the files this part wrote
};

// A part as a listing (and, where read, its record's first line) shows it.
struct StagedPart {
  std::string id;
  uint64_t record_bytes = 0;
  std::optional<PartMeta> meta;  // ListParts(read_meta = true)
};

// Where a staged version stands.
struct StagedState {
  enum Kind { kWaiting, kPublished, kConflict, kGone };
  Kind kind = kWaiting;
  int parts = 0;                       // N (from the intent; 0 if there is none)
  std::optional<std::string> parent;   // the intent's
  std::vector<StagedPart> in;          // records listed
  std::string message;                 // kConflict, kGone: what happened and what to do
  std::shared_ptr<const Manifest> published;  // kPublished: the version's head
};

// One staged version as the bucket shows it (weightfs status, log).
struct StagedSummary {
  std::string model, version;
  int parts = 0;
  std::optional<std::string> parent;
  int64_t created_ms = 0;
  std::vector<StagedPart> in;  // with meta
  std::string conflict;
};

// Staged versions as JSON (weightfs status and log): [{"model", "version", "parts", "parent",
// "conflict", "in": [{"id", "record_bytes", "host", "files", "removed", "stored_bytes",
// "logical_bytes", "created_ms"}]}].
std::string StagedJson(const std::vector<StagedSummary>& staged);

// Counts the elements of a parent file a version inherits (as push counts an unchanged file):
// {tensor elements, header bytes}; an opaque file is {0, size}. Needs the file's first chunk.
using ElementCounter =
    std::function<Expected<std::pair<uint64_t, uint64_t>>(const Manifest& parent, const ManifestFile& file)>;

class Materializer;

// Tensor elements and header bytes of a file of `manifest`, as push counts an unchanged file: a
// safetensors file's header chunk is parsed for its tensors; any other file is {0, size}.
Expected<std::pair<uint64_t, uint64_t>> ElementsOfFile(Materializer& materializer, const Manifest& manifest,
                                                       const ManifestFile& file);

class StagedVersion {
 public:
  // How long a writer that saw the set complete waits for the completer to publish.
  static constexpr std::chrono::milliseconds kPublishFallback{5000};

  StagedVersion(Bucket& bucket, std::string model, std::string version);

  static std::string Prefix(std::string_view model, std::string_view version);
  // InvalidArgument unless `id` is 1..64 of [A-Za-z0-9._-] (not starting with '.').
  static Status ValidatePartId(std::string_view id);
  // A part id from free text (a host name): invalid characters become '-'.
  static std::string SanitizePartId(std::string_view text);
  // Whether MODEL@VERSION is staged in parts (its staging prefix holds anything): a one-writer
  // publish of that name would publish one part's view of it, so commit and push refuse.
  static Expected<bool> IsStaged(Bucket& bucket, std::string_view model, std::string_view version);
  // Every staged version of the bucket (optionally of one model), with its parts' metadata.
  static Expected<std::vector<StagedSummary>> List(Bucket& bucket, std::string_view model = {});

  // Fixes N and the parent (the first part), or checks them: Conflict naming both parents (or
  // both N) when they differ. Published already: Ok (Step says whether with this part).
  Status Join(int parts, const std::optional<std::string>& parent);
  // When the intent was made (Unix ms; 0 if there is none).
  Expected<int64_t> IntentCreatedMs();
  // The intent, if there is one.
  Expected<std::optional<std::pair<int, std::optional<std::string>>>> Intent();
  // Join, put the record (its packs must be in the bucket), then one Step that publishes at once
  // if this record completed the set.
  Expected<StagedState> Submit(const PartRecord& part);
  // Looks once: published (and holding `ours` exactly: else kConflict), gone (our record
  // vanished: discarded or expired), conflict, or waiting; publishes if the set is complete
  // and (`publish_now` or it has been complete for kPublishFallback).
  Expected<StagedState> Step(const PartRecord& ours, bool publish_now = false);
  // Step until published (the kPublished state), a conflict or the record gone (Conflict),
  // `deadline` (Timeout), or `cancelled()` (Timeout); `progress` is called on every change of
  // the parts in. A bucket request that times out is IOError here: Timeout is the deadline's.
  Expected<StagedState> Wait(const PartRecord& ours, std::chrono::steady_clock::time_point deadline,
              const std::function<bool()>& cancelled = {},
              const std::function<void(const StagedState&)>& progress = {});
  // Deletes the intent, every record and the conflict marker (the packs go to gc).
  Expected<size_t> Discard();
  // Every record, parsed (the publisher's read: N requests).
  Expected<std::vector<PartRecord>> ReadParts();
  // The version as the parts make it, or Conflict naming the path and the parts.
  Expected<Manifest> Assemble(const std::vector<PartRecord>& parts);

  void set_element_counter(ElementCounter counter) { count_elements_ = std::move(counter); }

  static std::vector<uint8_t> SerializeRecord(const PartRecord& part);
  static Expected<PartRecord> ParseRecord(std::span<const uint8_t> bytes, std::string_view model,
                                          std::string_view version);
  static Expected<PartMeta> ParseMeta(std::span<const uint8_t> bytes);

 private:
  Expected<StagedState> Publish(const PartRecord& ours, StagedState state);
  // Whether the published version holds `ours` (its files, byte for byte, and not its removed ones).
  Status Holds(const Manifest& published_head, const PartRecord& ours);

  Bucket& bucket_;
  std::string model_, version_, prefix_;
  ElementCounter count_elements_;
  std::optional<std::chrono::steady_clock::time_point> complete_since_;
  std::optional<std::pair<int, std::optional<std::string>>> intent_;  // as read by Step
  std::optional<std::pair<int, std::optional<std::string>>> joined_;  // what Join checked
};

// `weightfs push --parts`: encodes `files` against `parent` (the staged version's, when one is
// fixed), uploads the packs under a lease, submits them as part `part.id` and, with `wait`,
// waits as StagedVersion::Wait does. The files no part writes are inherited from the parent.
struct PushPartOptions {
  int parts = 0;
  std::string id;
  bool wait = true;
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  std::function<void(const StagedState&)> progress;
};
Expected<StagedState> PushPart(Bucket& bucket, ChunkCache* cache, ThreadPool& pool, const VersionRef& target,
                               std::shared_ptr<const Manifest> parent, std::vector<PushFile> files,
                               const PushOptions& options, const PushPartOptions& part,
                               PushResult* result);

}  // namespace weightfs
