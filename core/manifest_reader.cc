// ParseManifest: reads a manifest (core/manifest.h has the format) from untrusted bytes.
//
// Memory is bounded by what the manifest holds, not by what its bytes claim:
// - A zstd frame is inflated as the JSON parser reads it, through a fixed buffer: its declared
//   content size is checked against the caller's limit and never sizes an allocation, and the
//   inflated bytes are counted against the limit as they come. Runs of whitespace are collapsed
//   on the way (nlohmann's lexer would keep them).
// - The JSON is read with nlohmann's SAX interface straight into the Manifest. No DOM is built
//   (a DOM costs ~5x the JSON text), values under keys the reader ignores are skipped without
//   being stored, and deep nesting costs a counter.
//
// Validation is the same whatever order the JSON's keys come in (SerializeManifest writes them
// sorted, "files" before "packs" and "versions"), and so is the error a damaged manifest gets:
// the first failing check in this order -- the format, the required fields, model, version,
// parent, created, chunk_bytes, versions, packs, sources, then each file: its own fields, then
// each chunk row (its fields, whether it starts where the previous one ended, whether it ends
// inside the file, whether its key repeats), whether the rows cover the file, whether the
// files are sorted; last, no path is both a file and a directory. Checks that need a table
// the JSON has not reached yet (a row naming a pack, a version or a source) are made once it
// has; the other checks of a row are made as it is read, and reading stops storing files at
// the first one that fails.
#include <zstd.h>
#include <zstd_errors.h>

#include <algorithm>
#include <cstring>
#include <istream>
#include <memory>
#include <new>
#include <numeric>
#include <optional>
#include <set>
#include <streambuf>
#include <tuple>

#include <nlohmann/json.hpp>

#include "core/ascii.h"
#include "core/file_codec.h"
#include "core/manifest.h"
#include "core/manifest_checks.h"

namespace weightfs {
namespace {

using json = nlohmann::json;
using namespace manifest_checks;

// The largest zstd window a manifest frame may make the decoder allocate. SerializeManifest
// (level 6) uses at most 2 MiB; every standard level up to 19 fits in 8 MiB.
constexpr int kMaxWindowLog = 23;

// A name inside a manifest that fails validation is damaged data from the bucket (Corruption,
// EIO to a reader), not a caller's mistake (InvalidArgument, EINVAL).
Status AsCorruption(const Status& s) { return s.ok() ? s : Status::Corruption(s.message()); }

// "1 GiB", "256 MiB" or "1234 bytes".
std::string FormatLimit(uint64_t bytes) {
  if (bytes >= (1ull << 30) && bytes % (1ull << 30) == 0) return std::to_string(bytes >> 30) + " GiB";
  if (bytes >= (1ull << 20) && bytes % (1ull << 20) == 0) return std::to_string(bytes >> 20) + " MiB";
  return std::to_string(bytes) + " bytes";
}

// ---------------------------------------------------------------------------------------------
// The text the parser reads.

// Collapses every run of JSON whitespace outside strings into one space, in place, as the text
// streams by. nlohmann's lexer keeps every character since the last string or number for its
// error messages, so a run of whitespace (what a zstd bomb inflates to best) would cost its
// own length in memory, twice over while the buffer doubles. JSON's grammar treats every such
// run alike, so the parse (acceptance and every value) is the same.
class WhitespaceCollapser {
 public:
  // Rewrites p[0, n) in place; returns the length left.
  size_t Collapse(char* p, size_t n) {
    size_t w = 0;
    for (size_t r = 0; r < n; ++r) {
      const char c = p[r];
      if (in_string_) {
        if (escaped_) {
          escaped_ = false;
        } else if (c == '\\') {
          escaped_ = true;
        } else if (c == '"') {
          in_string_ = false;
        }
      } else if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
        if (!space_) p[w++] = ' ';
        space_ = true;
        continue;
      } else if (c == '"') {
        in_string_ = true;
      }
      space_ = false;
      p[w++] = c;
    }
    return w;
  }

 private:
  bool in_string_ = false;
  bool escaped_ = false;
  bool space_ = false;  // the last character written was a collapsed run
};

// The manifest's JSON as the parser reads it, a block at a time through a fixed buffer: the
// bytes themselves, or a zstd frame inflated as it goes. For a frame it allocates the decoder,
// its window (at most 2^kMaxWindowLog bytes) and one output block, whatever the frame claims.
// At damage, at data after the frame, or past `max_bytes` of output it ends the text early and
// keeps the reason in status(), which the caller checks before anything the parser made of the
// truncated text.
class ManifestText : public std::streambuf {
 public:
  // Plain JSON.
  explicit ManifestText(std::span<const uint8_t> json) : plain_(json), buf_(new char[kPlainBlock]) {}
  // A zstd frame.
  ManifestText(std::span<const uint8_t> frame, uint64_t max_bytes, std::string subject)
      : in_{frame.data(), frame.size(), 0}, max_bytes_(max_bytes), subject_(std::move(subject)) {
    dctx_ = ZSTD_createDCtx();
    if (dctx_ == nullptr) {
      status_ = Status::ResourceExhausted(subject_ + ": out of memory for a zstd decoder");
      return;
    }
    ZSTD_DCtx_setParameter(dctx_, ZSTD_d_windowLogMax, kMaxWindowLog);
    buf_.reset(new char[ZSTD_DStreamOutSize()]);
  }
  ~ManifestText() override { ZSTD_freeDCtx(dctx_); }
  ManifestText(const ManifestText&) = delete;
  ManifestText& operator=(const ManifestText&) = delete;

  const Status& status() const { return status_; }

 protected:
  int_type underflow() override {
    for (size_t n; (n = dctx_ != nullptr ? Inflate() : Copy()) > 0;) {
      n = collapser_.Collapse(buf_.get(), n);
      if (n > 0) {
        setg(buf_.get(), buf_.get(), buf_.get() + n);
        return traits_type::to_int_type(*gptr());
      }
    }
    return traits_type::eof();
  }

 private:
  static constexpr size_t kPlainBlock = 64 << 10;

  // The next block of plain JSON into buf_; 0 at the end.
  size_t Copy() {
    const size_t n = std::min(kPlainBlock, plain_.size() - plain_at_);
    if (n > 0) std::memcpy(buf_.get(), plain_.data() + plain_at_, n);
    plain_at_ += n;
    return n;
  }

  // The next block of inflated JSON into buf_; 0 at the end of the frame or on error.
  size_t Inflate() {
    while (status_.ok()) {
      if (frame_done_) {
        if (in_.pos != in_.size) Fail(ZSTD_error_no_error, "data after the end of the frame");
        break;
      }
      ZSTD_outBuffer out{buf_.get(), ZSTD_DStreamOutSize(), 0};
      const size_t before = in_.pos;
      const size_t ret = ZSTD_decompressStream(dctx_, &out, &in_);
      if (ZSTD_isError(ret)) {
        Fail(ZSTD_getErrorCode(ret), ZSTD_getErrorName(ret));
        break;
      }
      frame_done_ = ret == 0;
      if (out.pos > 0) {
        produced_ += out.pos;
        if (produced_ > max_bytes_) {
          status_ = Status::ResourceExhausted(subject_ + ": inflates to more than " +
                                              FormatLimit(max_bytes_) + " of JSON (from " +
                                              std::to_string(in_.size) +
                                              " bytes of zstd), the limit for a manifest");
          break;
        }
        return out.pos;
      }
      if (!frame_done_ && in_.pos == before && in_.pos == in_.size) {
        Fail(ZSTD_error_no_error, "the frame is truncated");
      }
    }
    return 0;
  }

  void Fail(ZSTD_ErrorCode code, std::string_view why) {
    if (code == ZSTD_error_memory_allocation) {
      status_ = Status::ResourceExhausted(subject_ + ": out of memory inflating its zstd frame");
    } else if (code == ZSTD_error_frameParameter_windowTooLarge) {
      status_ = Status::ResourceExhausted(subject_ + ": zstd frame needs a window larger than " +
                                          FormatLimit(1ull << kMaxWindowLog));
    } else {
      status_ = Status::Corruption(subject_ + ": zstd frame does not decode (" + std::string(why) + ")");
    }
  }

  std::span<const uint8_t> plain_;
  size_t plain_at_ = 0;
  ZSTD_DCtx* dctx_ = nullptr;  // null for plain JSON
  ZSTD_inBuffer in_{};
  const uint64_t max_bytes_ = 0;
  const std::string subject_;
  std::unique_ptr<char[]> buf_;
  uint64_t produced_ = 0;
  bool frame_done_ = false;
  WhitespaceCollapser collapser_;
  Status status_;
};

// ---------------------------------------------------------------------------------------------
// Values.

// One JSON scalar as the SAX interface hands it over: null, an integer, a string, or anything
// else (a float, a boolean; a container where a scalar belongs, which is then skipped). A
// string may be moved from (nlohmann allows it).
struct Scalar {
  enum Kind : uint8_t { kOther, kNull, kSigned, kUnsigned, kString } kind = kOther;
  uint64_t u = 0;
  int64_t i = 0;
  std::string* text = nullptr;
};

// A non-negative integer (nlohmann reads "-0" as a signed 0, which counts), or nullopt.
std::optional<uint64_t> AsU64(const Scalar& v) {
  if (v.kind == Scalar::kUnsigned) return v.u;
  if (v.kind == Scalar::kSigned && v.i >= 0) return static_cast<uint64_t>(v.i);
  return std::nullopt;
}

Status NotU64(std::string_view what) {
  return Status::Corruption(std::string(what) + " is not a non-negative integer");
}

Status NotString(std::string_view what) {
  return Status::Corruption(std::string(what) + " is not a string");
}

// A string field of the top level or of a file entry: absent, a string, or something else.
struct StringField {
  bool seen = false;
  bool is_string = false;
  std::string value;

  void Set(const Scalar& v) {
    seen = true;
    is_string = v.kind == Scalar::kString;
    if (is_string) value = std::move(*v.text);
  }
};

// ---------------------------------------------------------------------------------------------
// The SAX handler.

class ManifestReader {
 public:
  // nlohmann's SAX interface. Returning false stops the parse (only for a top level that is
  // not an object); every other finding is kept and reported by Finish.
  bool null() {
    Scalar s;
    s.kind = Scalar::kNull;
    return OnScalar(s);
  }
  bool boolean(bool) { return OnScalar(Scalar{}); }
  bool number_integer(json::number_integer_t v) {
    Scalar s;
    s.kind = Scalar::kSigned;
    s.i = v;
    return OnScalar(s);
  }
  bool number_unsigned(json::number_unsigned_t v) {
    Scalar s;
    s.kind = Scalar::kUnsigned;
    s.u = v;
    return OnScalar(s);
  }
  bool number_float(json::number_float_t, const json::string_t&) { return OnScalar(Scalar{}); }
  bool string(json::string_t& v) {
    Scalar s;
    s.kind = Scalar::kString;
    s.text = &v;
    return OnScalar(s);
  }
  bool binary(json::binary_t&) { return OnScalar(Scalar{}); }
  bool start_object(std::size_t) { return OnOpen(/*object=*/true); }
  bool start_array(std::size_t) { return OnOpen(/*object=*/false); }
  bool end_object() { return OnClose(); }
  bool end_array() { return OnClose(); }
  bool key(json::string_t& k);
  template <class Exception>
  bool parse_error(std::size_t, const std::string&, const Exception&) {
    return false;  // any syntax error: "not a JSON object", as a DOM parse would say
  }

  // The manifest, or the first failing check (see the top of this file). REQUIRES: the parse
  // ran to its end without a syntax error.
  Expected<Manifest> Finish(std::string_view expected_model, std::string_view expected_version);

  bool not_object() const { return not_object_; }

 private:
  // Where the parser is: the containers the reader looks into, innermost last.
  enum class Ctx : uint8_t {
    kTop, kVersions, kPacks, kSources, kStats, kFiles, kFile, kChunks, kRow, kTable, kSection
  };
  enum class TopKey : uint8_t {
    kOther, kFormat, kModel, kVersion, kParent, kCreated, kChunkBytes, kVersions, kPacks,
    kSources, kStats, kFiles, kTable, kCount
  };
  enum class FileKey : uint8_t { kOther, kPath, kSize, kSha256, kChunks, kRows, kSection, kCount };
  enum class StatKey : uint8_t { kOther, kLogical, kStored, kChanged, kElements };

  // A table (versions, packs, sources): how many entries, the first bad one.
  struct Table {
    bool is_array = false;
    uint64_t count = 0;
    Status error;
  };

  // The first failing check among the files, and where it is in the reader's order:
  // (file, row, stage) with row 0 for the file's own fields, r + 1 for chunk row r (stage 0
  // its fields, 1 its offset, 2 the file's size, 3 its key), and beyond the rows for the
  // coverage and order of the file.
  struct FilesError {
    size_t file = 0;
    uint64_t row = 0;
    int stage = 0;
    Status status;  // with the file's context, without the manifest's
    // For a row that failed CheckRow with the tables' caps, or its offset check: the row, to
    // check again with the real tables (an index check may come first).
    std::optional<RawRow> raw;
  };

  // The file entry being read.
  struct FileState {
    std::string repeated_key;
    StringField path;
    StringField sha256;
    bool seen_size = false;
    std::optional<uint64_t> size;  // nullopt: not a non-negative integer
    bool seen_chunks = false;
    bool chunks_is_array = false;
    // Format 2: the row count and [offset, length] of the file's table section instead of rows.
    bool seen_rows = false, seen_section = false;
    std::optional<uint64_t> row_count;
    std::vector<std::optional<uint64_t>> section;  // as read; valid: two integers
    bool section_is_array = false;
    uint64_t rows = 0;  // chunk rows seen
    uint64_t pos = 0;   // where the next row must start
    // The first row that failed as it was read (stage 0 or 1); later rows are only counted.
    std::optional<FilesError> row_error;
  };

  bool OnScalar(const Scalar& v);
  bool OnOpen(bool object);
  bool OnClose();
  void Skip() { skip_ = 1; }
  void TopValue(const Scalar& v);
  void TableEntry(Ctx table, const Scalar& v);
  void FileValue(const Scalar& v);
  void RowColumn(const Scalar& v);
  void StartFile();
  void FinishRow();
  void FinishFile();
  Status FileFields(ManifestFile* f);
  // The first failing check among the files, with the real tables.
  Status FilesStatus(const Tables& t) const;

  std::vector<Ctx> stack_;
  uint64_t skip_ = 0;  // > 0: inside a value nobody reads, this many containers deep
  bool not_object_ = false;

  // The top level.
  TopKey top_key_ = TopKey::kOther;
  bool seen_[static_cast<size_t>(TopKey::kCount)] = {};
  std::string repeated_top_key_;
  Scalar::Kind format_kind_ = Scalar::kOther;
  uint64_t format_u_ = 0;
  int64_t format_i_ = 0;
  StringField model_, version_, parent_, created_;
  bool parent_null_ = false;
  std::optional<uint64_t> chunk_bytes_;
  // Format 2: the table object ({"pack": hex, "size": n}).
  bool table_is_object_ = false;
  std::string table_key_;
  StringField table_pack_;
  std::optional<uint64_t> table_size_;
  bool table_bad_ = false;
  Table versions_, packs_, sources_;
  std::set<std::string> seen_versions_, seen_sources_;
  StatKey stat_key_ = StatKey::kOther;
  bool files_is_array_ = false;

  // The files.
  FileKey file_key_ = FileKey::kOther;
  bool file_seen_[static_cast<size_t>(FileKey::kCount)] = {};
  FileState file_;
  RawRow row_;
  std::optional<FilesError> files_error_;  // set: later files are skipped

  Manifest m_;
};

bool ManifestReader::key(json::string_t& k) {
  if (skip_ > 0) return true;
  switch (stack_.back()) {
    case Ctx::kTop: {
      static constexpr std::pair<std::string_view, TopKey> kKeys[] = {
          {"format", TopKey::kFormat},   {"model", TopKey::kModel},
          {"version", TopKey::kVersion}, {"parent", TopKey::kParent},
          {"created", TopKey::kCreated}, {"chunk_bytes", TopKey::kChunkBytes},
          {"versions", TopKey::kVersions}, {"packs", TopKey::kPacks},
          {"sources", TopKey::kSources}, {"stats", TopKey::kStats},
          {"files", TopKey::kFiles},     {"table", TopKey::kTable}};
      top_key_ = TopKey::kOther;
      for (const auto& [name, id] : kKeys) {
        if (k == name) top_key_ = id;
      }
      if (top_key_ != TopKey::kOther) {
        bool& seen = seen_[static_cast<size_t>(top_key_)];
        if (seen) {
          // nlohmann's DOM would keep the last; a reader that kept the first would see another
          // manifest. Refused, and the value is not read.
          if (repeated_top_key_.empty()) repeated_top_key_ = k;
          top_key_ = TopKey::kOther;
        }
        seen = true;
      }
      break;
    }
    case Ctx::kStats:
      stat_key_ = k == "logical_bytes"      ? StatKey::kLogical
                  : k == "stored_bytes"     ? StatKey::kStored
                  : k == "changed_elements" ? StatKey::kChanged
                  : k == "elements"         ? StatKey::kElements
                                            : StatKey::kOther;
      break;
    case Ctx::kTable:
      table_key_ = k;
      break;
    case Ctx::kFile: {
      file_key_ = k == "path"      ? FileKey::kPath
                  : k == "size"    ? FileKey::kSize
                  : k == "sha256"  ? FileKey::kSha256
                  : k == "chunks"  ? FileKey::kChunks
                  : k == "rows"    ? FileKey::kRows
                  : k == "section" ? FileKey::kSection
                                   : FileKey::kOther;
      if (file_key_ != FileKey::kOther) {
        bool& seen = file_seen_[static_cast<size_t>(file_key_)];
        if (seen) {
          if (file_.repeated_key.empty()) file_.repeated_key = k;
          file_key_ = FileKey::kOther;
        }
        seen = true;
      }
      break;
    }
    default:
      break;  // arrays have no keys
  }
  return true;
}

bool ManifestReader::OnScalar(const Scalar& v) {
  if (skip_ > 0) return true;
  if (stack_.empty()) {  // the whole document is a scalar
    not_object_ = true;
    return false;
  }
  switch (stack_.back()) {
    case Ctx::kTop:
      TopValue(v);
      break;
    case Ctx::kVersions:
    case Ctx::kPacks:
    case Ctx::kSources:
      TableEntry(stack_.back(), v);
      break;
    case Ctx::kStats: {
      uint64_t* field = stat_key_ == StatKey::kLogical   ? &m_.stats.logical_bytes
                        : stat_key_ == StatKey::kStored  ? &m_.stats.stored_bytes
                        : stat_key_ == StatKey::kChanged ? &m_.stats.changed_elements
                        : stat_key_ == StatKey::kElements ? &m_.stats.elements
                                                          : nullptr;
      // Stats are informational: a value of the wrong type is ignored, not an error.
      if (field != nullptr) *field = AsU64(v).value_or(0);
      break;
    }
    case Ctx::kFiles:
      if (!files_error_) {
        StartFile();
        files_error_ = FilesError{m_.files.size() - 1, 0, 0,
                                  Status::Corruption("file entry is not an object"), std::nullopt};
      }
      break;
    case Ctx::kFile:
      FileValue(v);
      break;
    case Ctx::kChunks:
      ++file_.rows;
      if (!file_.row_error) {
        file_.row_error = FilesError{m_.files.size() - 1, file_.rows, 0,
                                     Status::Corruption("chunk row is not an array of 14"), std::nullopt};
      }
      break;
    case Ctx::kRow:
      RowColumn(v);
      break;
    case Ctx::kTable:
      if (table_key_ == "pack") {
        if (table_pack_.seen) table_bad_ = true;
        table_pack_.Set(v);
      } else if (table_key_ == "size") {
        if (table_size_) table_bad_ = true;
        table_size_ = AsU64(v);
        if (!table_size_) table_bad_ = true;
      }
      break;
    case Ctx::kSection:
      if (file_.section.size() < 4) file_.section.push_back(AsU64(v));
      break;
  }
  return true;
}

bool ManifestReader::OnOpen(bool object) {
  if (skip_ > 0) {
    ++skip_;
    return true;
  }
  if (stack_.empty()) {
    if (!object) {
      not_object_ = true;
      return false;
    }
    stack_.push_back(Ctx::kTop);
    return true;
  }
  switch (stack_.back()) {
    case Ctx::kTop: {
      const TopKey k = top_key_;
      if (!object && k == TopKey::kVersions) {
        versions_.is_array = true;
        stack_.push_back(Ctx::kVersions);
      } else if (!object && k == TopKey::kPacks) {
        packs_.is_array = true;
        stack_.push_back(Ctx::kPacks);
      } else if (!object && k == TopKey::kSources) {
        sources_.is_array = true;
        stack_.push_back(Ctx::kSources);
      } else if (object && k == TopKey::kStats) {
        stack_.push_back(Ctx::kStats);
      } else if (!object && k == TopKey::kFiles) {
        files_is_array_ = true;
        stack_.push_back(Ctx::kFiles);
      } else if (object && k == TopKey::kTable) {
        table_is_object_ = true;
        stack_.push_back(Ctx::kTable);
      } else {
        TopValue(Scalar{});  // a container where a scalar belongs: the field's type is wrong
        Skip();
      }
      return true;
    }
    case Ctx::kVersions:
    case Ctx::kPacks:
    case Ctx::kSources:
      TableEntry(stack_.back(), Scalar{});
      Skip();
      return true;
    case Ctx::kStats:
      OnScalar(Scalar{});
      Skip();
      return true;
    case Ctx::kFiles:
      if (object && !files_error_) {
        StartFile();
        stack_.push_back(Ctx::kFile);
      } else {
        OnScalar(Scalar{});
        Skip();
      }
      return true;
    case Ctx::kFile:
      if (!object && file_key_ == FileKey::kChunks) {
        file_.seen_chunks = file_.chunks_is_array = true;
        stack_.push_back(Ctx::kChunks);
      } else if (!object && file_key_ == FileKey::kSection) {
        file_.seen_section = file_.section_is_array = true;
        stack_.push_back(Ctx::kSection);
      } else {
        FileValue(Scalar{});
        Skip();
      }
      return true;
    case Ctx::kChunks:
      if (!object && !file_.row_error) {
        ++file_.rows;
        row_.Reset();
        stack_.push_back(Ctx::kRow);
      } else {
        OnScalar(Scalar{});
        Skip();
      }
      return true;
    case Ctx::kRow:
      RowColumn(Scalar{});
      Skip();
      return true;
    case Ctx::kTable:
      table_bad_ = table_bad_ || table_key_ == "pack" || table_key_ == "size";
      Skip();
      return true;
    case Ctx::kSection:
      file_.section.push_back(std::nullopt);
      Skip();
      return true;
  }
  return true;
}

bool ManifestReader::OnClose() {
  if (skip_ > 0) {
    --skip_;
    return true;
  }
  const Ctx done = stack_.back();
  stack_.pop_back();
  if (done == Ctx::kRow) FinishRow();
  if (done == Ctx::kFile) FinishFile();
  return true;
}

void ManifestReader::TopValue(const Scalar& v) {
  switch (top_key_) {
    case TopKey::kFormat:
      format_kind_ = v.kind;
      format_u_ = v.u;
      format_i_ = v.i;
      break;
    case TopKey::kModel:
      model_.Set(v);
      break;
    case TopKey::kVersion:
      version_.Set(v);
      break;
    case TopKey::kParent:
      parent_null_ = v.kind == Scalar::kNull;
      parent_.Set(v);
      break;
    case TopKey::kCreated:
      created_.Set(v);
      break;
    case TopKey::kChunkBytes:
      chunk_bytes_ = AsU64(v);
      break;
    default:
      break;  // a table, stats or files that is not a container: Finish sees no container
  }
}

void ManifestReader::TableEntry(Ctx table, const Scalar& v) {
  Table& t = table == Ctx::kVersions ? versions_ : table == Ctx::kPacks ? packs_ : sources_;
  const uint64_t index = t.count++;
  if (!t.error.ok()) return;
  switch (table) {
    case Ctx::kVersions: {
      if (index >= kMaxTableEntries) return;  // Finish refuses the count
      if (v.kind != Scalar::kString) {
        t.error = NotString("versions entry");
      } else if (Status s = AsCorruption(ValidateVersionName(*v.text)); !s.ok()) {
        t.error = s;
      } else if (!seen_versions_.insert(*v.text).second) {
        t.error = Status::Corruption("duplicate entry in versions");
      } else {
        m_.versions.push_back(std::move(*v.text));
      }
      return;
    }
    case Ctx::kPacks:
      if (index >= kMaxPacks) return;
      if (v.kind != Scalar::kString || !IsLowerHex(*v.text, 32)) {
        t.error = Status::Corruption("pack name is not 32 hex digits");
      } else {
        m_.packs.push_back(*Hash128::FromHex(*v.text));
      }
      return;
    default: {
      if (index >= kMaxTableEntries) return;
      if (v.kind != Scalar::kString) {
        t.error = NotString("source");
      } else if (Status s = AsCorruption(ValidateSourceName(*v.text)); !s.ok()) {
        t.error = s;
      } else if (!seen_sources_.insert(*v.text).second) {
        t.error = Status::Corruption("duplicate entry in sources");
      } else {
        m_.sources.push_back(std::move(*v.text));
      }
      return;
    }
  }
}

void ManifestReader::StartFile() {
  m_.files.emplace_back();
  file_ = FileState{};
  std::fill(std::begin(file_seen_), std::end(file_seen_), false);
}

void ManifestReader::FileValue(const Scalar& v) {
  switch (file_key_) {
    case FileKey::kPath:
      file_.path.Set(v);
      break;
    case FileKey::kSize:
      file_.seen_size = true;
      file_.size = AsU64(v);
      break;
    case FileKey::kSha256:
      file_.sha256.Set(v);
      break;
    case FileKey::kChunks:
      file_.seen_chunks = true;
      file_.chunks_is_array = false;
      break;
    case FileKey::kRows:
      file_.seen_rows = true;
      file_.row_count = AsU64(v);
      break;
    case FileKey::kSection:
      file_.seen_section = true;
      file_.section_is_array = false;
      break;
    default:
      break;
  }
}

void ManifestReader::RowColumn(const Scalar& v) {
  const size_t col = row_.columns++;
  if (col >= kRowColumns || !row_.error.ok()) return;
  if (col == kTensor || col == kHash) {
    if (v.kind != Scalar::kString) {
      row_.error = NotString(kColumnNames[col]);
    } else if (col == kTensor) {
      row_.tensor.assign(*v.text);  // one exact allocation; the lexer keeps its buffer
    } else if (Expected<Hash128> h = Hash128::FromHex(*v.text); h.ok()) {
      row_.hash = *h;
    } else {
      row_.error = h.status();
    }
    return;
  }
  if (std::optional<uint64_t> x = AsU64(v)) {
    row_.v[col] = *x;
  } else {
    row_.error = NotU64(kColumnNames[col]);
  }
}

void ManifestReader::FinishRow() {
  const size_t file = m_.files.size() - 1;
  const uint64_t r = file_.rows - 1;
  auto fail = [&](int stage, Status s, bool keep_row) {
    file_.row_error = FilesError{file, r + 1, stage, std::move(s),
                                 keep_row ? std::optional<RawRow>(row_) : std::nullopt};
  };
  if (row_.columns != kRowColumns) return fail(0, Status::Corruption("chunk row is not an array of 14"), false);
  if (!row_.error.ok()) return fail(0, row_.error, false);
  ManifestChunk c;
  if (Status s = CheckRow(row_, Tables{}, &c); !s.ok()) return fail(0, s, true);
  if (c.offset != file_.pos) {
    return fail(1, Status::Corruption("chunk " + std::to_string(r) +
                                      " does not start where the previous one ends"), true);
  }
  file_.pos += c.length;
  c.key.tensor = std::move(row_.tensor);
  m_.files.back().chunks.push_back(std::move(c));
}

Status ManifestReader::FileFields(ManifestFile* f) {
  if (!file_.repeated_key.empty()) {
    return Status::Corruption("file entry repeats key '" + file_.repeated_key + "'");
  }
  if (!file_.path.seen) return Status::Corruption("file entry without a path");
  if (!file_.path.is_string) return NotString("file path");
  f->path = std::move(file_.path.value);
  WFS_TRY(AsCorruption(ValidateFilePath(f->path)));  // Finish adds "manifest M@V"
  auto ctx = [&](const Status& s) { return s.WithContext("file '" + f->path + "'"); };
  const bool sectioned = file_.seen_rows || file_.seen_section;  // format 2
  if (!file_.seen_size || !file_.sha256.seen || (sectioned ? file_.seen_chunks : !file_.seen_chunks) ||
      (!sectioned && !file_.chunks_is_array)) {
    return ctx(Status::Corruption("missing size, sha256 or chunks"));
  }
  if (!file_.size) return ctx(NotU64("size"));
  f->size = *file_.size;
  if (f->size > kMaxFileSize) return ctx(Status::Corruption("file size out of range"));
  if (!file_.sha256.is_string || !IsLowerHex(file_.sha256.value, 64)) {
    return ctx(Status::Corruption("sha256 is not 64 lowercase hex digits"));
  }
  f->sha256 = std::move(file_.sha256.value);
  if (file_.rows > f->size) return ctx(Status::Corruption("more chunks than bytes"));
  if (sectioned) {
    if (!file_.seen_rows || !file_.row_count) return ctx(NotU64("rows"));
    // [offset, length], or [offset, length, index length] for a section in blocks.
    const size_t n = file_.section.size();
    if (!file_.section_is_array || n < 2 || n > 3 || !std::all_of(file_.section.begin(), file_.section.end(),
                                                                   [](const auto& v) { return v.has_value(); })) {
      return ctx(Status::Corruption("section is not [offset, length] or [offset, length, index length]"));
    }
    const uint64_t rows = *file_.row_count;
    if (rows > f->size || (rows == 0) != (f->size == 0)) {
      return ctx(Status::Corruption(std::to_string(rows) + " rows for " + std::to_string(f->size) + " bytes"));
    }
    f->rows_loaded = false;
    f->section = TableSection{*file_.section[0], *file_.section[1], rows, n == 3 ? *file_.section[2] : 0};
    if (f->section.offset > kMaxFileSize || f->section.length > kMaxFileSize) {
      return ctx(Status::Corruption("section out of range"));
    }
    if (n == 3 && (f->section.index_length == 0 || f->section.index_length >= f->section.length)) {
      return ctx(Status::Corruption("the section's block index does not fit in it"));
    }
  }
  return Status::Ok();
}

void ManifestReader::FinishFile() {
  const size_t file = m_.files.size() - 1;
  ManifestFile& f = m_.files[file];
  if (Status s = FileFields(&f); !s.ok()) {
    files_error_ = FilesError{file, 0, 0, s, std::nullopt};
    return;
  }
  const std::string where = "file '" + f.path + "'";
  // The first of: the row that failed as it was read, the first row past the file's size (known
  // only now), the first repeated key.
  std::optional<FilesError> first;
  auto consider = [&](FilesError e) {
    if (!first || std::tie(e.row, e.stage) < std::tie(first->row, first->stage)) first = std::move(e);
  };
  if (file_.row_error) {
    FilesError e = std::move(*file_.row_error);
    if (e.stage == 0) e.status = e.status.WithContext("chunk " + std::to_string(e.row - 1));
    e.status = e.status.WithContext(where);
    consider(std::move(e));
  }
  // The rows kept tile [0, pos), so their ends increase.
  const auto past = std::partition_point(f.chunks.begin(), f.chunks.end(), [&](const ManifestChunk& c) {
    return c.offset + c.length <= f.size;
  });
  if (past != f.chunks.end()) {
    consider(FilesError{file, static_cast<uint64_t>(past - f.chunks.begin()) + 1, 2,
                        Status::Corruption("chunks extend past the file size").WithContext(where),
                        std::nullopt});
  }
  if (std::optional<size_t> k = FirstRepeatedKey(f.chunks)) {
    consider(FilesError{file, *k + 1, 3,
                        Status::Corruption("duplicate chunk key " + DescribeChunk(f.chunks[*k].key))
                            .WithContext(where),
                        std::nullopt});
  }
  if (first) {
    files_error_ = std::move(first);
    return;
  }
  if (file_.pos != f.size && f.rows_loaded) {
    files_error_ = FilesError{file, file_.rows + 1, 0,
                              Status::Corruption("chunks do not cover the file").WithContext(where),
                              std::nullopt};
    return;
  }
  if (file > 0 && !(m_.files[file - 1].path < f.path)) {
    files_error_ = FilesError{file, file_.rows + 2, 0,
                              Status::Corruption("files are not sorted by path or repeat one"),
                              std::nullopt};
  }
}

Status ManifestReader::FilesStatus(const Tables& t) const {
  const FilesError* e = files_error_ ? &*files_error_ : nullptr;
  // The index checks of the rows kept before the first other failure.
  for (size_t i = 0; i < m_.files.size(); ++i) {
    if (e != nullptr && i == e->file && e->row == 0) break;
    const ManifestFile& f = m_.files[i];
    uint64_t rows = f.chunks.size();
    // A row that failed at stage 2 or 3 passed its own checks and was kept: its index checks
    // come first.
    if (e != nullptr && i == e->file) rows = std::min(rows, e->stage >= 2 ? e->row : e->row - 1);
    for (uint64_t k = 0; k < rows; ++k) {
      if (Status s = CheckRefs(f.chunks[k], t); !s.ok()) {
        return s.WithContext("chunk " + std::to_string(k)).WithContext("file '" + f.path + "'");
      }
    }
    if (e != nullptr && i == e->file) break;
  }
  if (e == nullptr) return Status::Ok();
  if (e->raw) {
    if (Status s = CheckRow(*e->raw, t, nullptr); !s.ok()) {
      return s.WithContext("chunk " + std::to_string(e->row - 1))
          .WithContext("file '" + m_.files[e->file].path + "'");
    }
  }
  return e->status;
}

Expected<Manifest> ManifestReader::Finish(std::string_view expected_model,
                                          std::string_view expected_version) {
  auto seen = [&](TopKey k) { return seen_[static_cast<size_t>(k)]; };
  if (!repeated_top_key_.empty()) {
    return Status::Corruption("manifest repeats key '" + repeated_top_key_ + "'");
  }
  if (!seen(TopKey::kFormat) || (format_kind_ != Scalar::kSigned && format_kind_ != Scalar::kUnsigned)) {
    return Status::Corruption("manifest has no format");
  }
  const int64_t format = format_kind_ == Scalar::kUnsigned
                             ? static_cast<int64_t>(std::min<uint64_t>(format_u_, 1u << 30))
                             : format_i_;
  if (format != 1 && format != kManifestFormat2) {
    return Status::Unsupported("manifest format " + std::to_string(format) +
                               " (this weightfs reads formats 1 and 2; upgrade weightfs)");
  }
  m_.format = static_cast<int>(format);
  static constexpr std::pair<const char*, TopKey> kRequired[] = {
      {"model", TopKey::kModel},     {"version", TopKey::kVersion},
      {"created", TopKey::kCreated}, {"chunk_bytes", TopKey::kChunkBytes},
      {"versions", TopKey::kVersions}, {"packs", TopKey::kPacks},
      {"files", TopKey::kFiles}};
  for (const auto& [name, k] : kRequired) {
    if (!seen(k)) return Status::Corruption(std::string("manifest has no '") + name + "'");
  }
  if (!model_.is_string) return NotString("model");
  if (!version_.is_string) return NotString("version");
  m_.model = std::move(model_.value);
  m_.version = std::move(version_.value);
  WFS_TRY(AsCorruption(ValidateModelName(m_.model)).WithContext("manifest"));
  WFS_TRY(AsCorruption(ValidateVersionName(m_.version)).WithContext("manifest"));
  if (!expected_model.empty() && m_.model != expected_model) {
    return Status::Corruption("manifest names model '" + m_.model + "' but is stored under '" +
                              std::string(expected_model) + "'");
  }
  if (!expected_version.empty() && m_.version != expected_version) {
    return Status::Corruption("manifest names version '" + m_.version + "' but is stored under '" +
                              std::string(expected_version) + "'");
  }
  auto ctx = [&](const Status& s) { return s.WithContext("manifest " + m_.model + "@" + m_.version); };
  if (parent_.seen && !parent_null_) {
    if (!parent_.is_string) return ctx(NotString("parent"));
    WFS_TRY(ctx(AsCorruption(ValidateVersionName(parent_.value))));
    if (parent_.value == m_.version) return ctx(Status::Corruption("version is its own parent"));
    m_.parent = std::move(parent_.value);
  }
  if (!created_.is_string) return ctx(NotString("created"));
  m_.created = std::move(created_.value);
  Expected<int64_t> when = ParseUtc(m_.created);
  if (!when.ok()) return ctx(when.status());
  m_.created_ms = *when;
  if (!chunk_bytes_) return ctx(NotU64("chunk_bytes"));
  if (*chunk_bytes_ == 0 || *chunk_bytes_ > kMaxChunkBytes) {
    return ctx(Status::Corruption("chunk_bytes out of range"));
  }
  m_.chunk_bytes = *chunk_bytes_;
  if (!versions_.is_array || versions_.count == 0 || versions_.count > kMaxTableEntries) {
    return ctx(Status::Corruption("versions is not a non-empty array"));
  }
  WFS_TRY(ctx(versions_.error));
  if (m_.versions[0] != m_.version) return ctx(Status::Corruption("versions[0] is not the version itself"));
  if (!packs_.is_array) return ctx(Status::Corruption("packs is not an array"));
  WFS_TRY(ctx(packs_.error));
  if (packs_.count > kMaxPacks) {
    return ctx(Status::Corruption("packs has more than " + std::to_string(kMaxPacks) + " entries"));
  }
  if (seen(TopKey::kSources)) {
    if (!sources_.is_array || sources_.count > kMaxTableEntries) {
      return ctx(Status::Corruption("sources is not an array"));
    }
    WFS_TRY(ctx(sources_.error));
  }
  if (!files_is_array_) return ctx(Status::Corruption("files is not an array"));
  // Format 2: a table object whose sections hold the rows; format 1: rows inline.
  if (m_.format == kManifestFormat2) {
    if (!seen(TopKey::kTable) || !table_is_object_ || table_bad_ || !table_pack_.is_string ||
        !IsLowerHex(table_pack_.value, 32) || !table_size_) {
      return ctx(Status::Corruption("table is not {\"pack\": 32 hex digits, \"size\": bytes}"));
    }
    m_.table = *Hash128::FromHex(table_pack_.value);
    m_.table_size = *table_size_;
  } else if (seen(TopKey::kTable)) {
    return ctx(Status::Corruption("a format 1 manifest with a table"));
  }
  WFS_TRY(ctx(FilesStatus(Tables{m_.versions.size(), m_.packs.size(), m_.sources.size()})));
  for (const ManifestFile& f : m_.files) {
    if (f.rows_loaded != (m_.format == 1)) {
      return ctx(Status::Corruption("file '" + f.path + "' has " + (f.rows_loaded ? "rows inline" : "a table section") +
                                    " in a format " + std::to_string(m_.format) + " manifest"));
    }
    if (!f.rows_loaded && (f.section.offset > m_.table_size || f.section.length > m_.table_size - f.section.offset)) {
      return ctx(Status::Corruption("file '" + f.path + "': its section ends past the table"));
    }
  }
  // A file path must not also be a directory of another file ("a" and "a/b"). At most 1024
  // nested prefixes (the path limit), so this is linear in the files.
  for (size_t i = 1; i < m_.files.size(); ++i) {
    const std::string& prev = m_.files[i - 1].path;
    for (size_t k = i; k < m_.files.size() && m_.files[k].path.compare(0, prev.size(), prev) == 0; ++k) {
      if (m_.files[k].path.size() > prev.size() && m_.files[k].path[prev.size()] == '/') {
        return ctx(Status::Corruption("'" + prev + "' is both a file and a directory"));
      }
    }
  }
  return std::move(m_);
}

// "manifest MODEL@VERSION" when the caller named it, "manifest" otherwise.
std::string Subject(std::string_view model, std::string_view version) {
  if (model.empty() && version.empty()) return "manifest";
  return "manifest " + std::string(model.empty() ? "?" : model) + "@" +
         std::string(version.empty() ? "?" : version);
}

Expected<Manifest> Parse(std::span<const uint8_t> bytes, std::string_view expected_model,
                         std::string_view expected_version, uint64_t max_json_bytes) {
  const std::string subject = Subject(expected_model, expected_version);
  ManifestReader reader;
  bool parsed = false;
  if (bytes.size() >= 4 && bytes[0] == 0x28 && bytes[1] == 0xB5 && bytes[2] == 0x2F &&
      bytes[3] == 0xFD) {
    const unsigned long long size = ZSTD_getFrameContentSize(bytes.data(), bytes.size());
    if (size == ZSTD_CONTENTSIZE_ERROR || size == ZSTD_CONTENTSIZE_UNKNOWN) {
      return Status::Corruption(subject + ": not a valid zstd frame");
    }
    if (size > max_json_bytes) {
      return Status::ResourceExhausted(subject + ": zstd frame of " + std::to_string(bytes.size()) +
                                       " bytes claims " + std::to_string(size) +
                                       " bytes of JSON, larger than " + FormatLimit(max_json_bytes) +
                                       " (the limit for a manifest)");
    }
    // Every block that yields output costs at least 4 bytes (3 of header) and yields at most
    // 128 KiB, so no frame expands more than 32768x: a claim beyond that is a lie.
    if (size > static_cast<uint64_t>(bytes.size()) * 32768) {
      return Status::Corruption(subject + ": zstd frame of " + std::to_string(bytes.size()) +
                                " bytes claims " + std::to_string(size) + " bytes");
    }
    ManifestText text(bytes, max_json_bytes, subject);
    WFS_TRY(text.status());
    std::istream in(&text);
    parsed = json::sax_parse(in, &reader);
    WFS_TRY(text.status());  // damage or the limit: before whatever the parser made of it
  } else {
    if (bytes.size() > max_json_bytes) {
      return Status::ResourceExhausted(subject + ": " + std::to_string(bytes.size()) +
                                       " bytes of JSON, larger than " + FormatLimit(max_json_bytes) +
                                       " (the limit for a manifest)");
    }
    ManifestText text(bytes);
    std::istream in(&text);
    parsed = json::sax_parse(in, &reader);
  }
  if (!parsed || reader.not_object()) return Status::Corruption("manifest is not a JSON object");
  return reader.Finish(expected_model, expected_version);
}

}  // namespace

Expected<Manifest> ParseManifest(std::span<const uint8_t> bytes, std::string_view expected_model,
                                 std::string_view expected_version, uint64_t max_json_bytes) {
  try {
    return Parse(bytes, expected_model, expected_version, max_json_bytes);
  } catch (const std::bad_alloc&) {
    // What the reader keeps is bounded by max_json_bytes, but the caller's memory may be
    // smaller still: one manifest fails, not the process.
    return Status::ResourceExhausted(Subject(expected_model, expected_version) +
                                     ": out of memory reading " + std::to_string(bytes.size()) +
                                     " bytes");
  }
}

}  // namespace weightfs
