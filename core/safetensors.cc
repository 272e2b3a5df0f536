#include "core/safetensors.h"

#include <algorithm>
#include <cassert>
#include <cstring>
#include <new>
#include <optional>
#include <string_view>
#include <tuple>
#include <unordered_set>
#include <utility>

#include <nlohmann/json.hpp>

// Byte layout read and written here:
//
//   offset 0      u64 little-endian N, 0 < N <= kMaxSafetensorsHeaderBytes
//   offset 8      N bytes: a UTF-8 JSON object starting with '{', optionally followed by
//                 JSON whitespace (the reference writer pads with spaces to an 8-byte boundary)
//   offset 8 + N  the data section; tensor i occupies [8 + N + begin_i, 8 + N + end_i)
//
// The JSON object maps "__metadata__" (optional) to an object of string -> string, and every
// other key (a tensor name, non-empty) to exactly
//   {"dtype": "<safetensors dtype>", "shape": [u64, ...], "data_offsets": [begin, end]}.
// Keys are unique at every level we interpret. Sorted by (begin, end), the tensors tile the
// data section [0, file_size - 8 - N) exactly: no gap, no overlap, nothing after the last one.
// A zero-size tensor [x, x) may sit at any tiling boundary x, including 0 and the very end.
// The rules, and the (begin, end) order, follow Metadata::validate in huggingface/safetensors.

namespace weightfs {
namespace {

using Json = nlohmann::json;

constexpr uint64_t kLengthBytes = 8;
constexpr std::string_view kMetadataKey = "__metadata__";

// Containers nest at most three deep in a valid header: the top-level object, a tensor entry
// (or __metadata__), and a shape / data_offsets array. Anything deeper is rejected before
// nlohmann builds a DOM, so a 100 MB "[[[[..." costs neither memory nor time.
constexpr int kMaxJsonDepth = 3;

// Appends `s` with control bytes escaped as \xNN. Quoting mode (!ascii_only) also escapes quotes
// and backslashes; ascii_only mode escapes bytes >= 0x80 instead (for text that may hold
// invalid UTF-8, such as a JSON parser's message quoting the input).
void AppendEscaped(std::string_view s, bool ascii_only, std::string* out) {
  static constexpr char kHex[] = "0123456789abcdef";
  for (char c : s) {
    const auto b = static_cast<unsigned char>(c);
    const bool special = ascii_only ? b >= 0x80 : (c == '\'' || c == '\\');
    if (b < 0x20 || b == 0x7F || special) {
      *out += "\\x";
      *out += kHex[b >> 4];
      *out += kHex[b & 0xF];
    } else {
      *out += c;
    }
  }
}

// Names and other strings from the file are quoted into messages, truncated and escaped, so a
// hostile 100 MB name cannot flood a log line. The parser has checked they are valid UTF-8.
std::string Quote(std::string_view s) {
  constexpr size_t kMaxQuoted = 64;
  size_t n = s.size();
  const bool cut = n > kMaxQuoted;
  if (cut) {
    n = kMaxQuoted;
    // Back off to a UTF-8 code point boundary.
    while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;
  }
  std::string out = "'";
  AppendEscaped(s.substr(0, n), /*ascii_only=*/false, &out);
  if (cut) out += "...";
  out += '\'';
  return out;
}

std::string Range(uint64_t begin, uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}

std::string FormatShape(const std::vector<uint64_t>& shape) {
  constexpr size_t kMaxDims = 8;
  std::string out = "[";
  for (size_t i = 0; i < shape.size() && i < kMaxDims; ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(shape[i]);
  }
  if (shape.size() > kMaxDims) out += ", ... (" + std::to_string(shape.size()) + " dims)";
  out += "]";
  return out;
}

// What a JSON value was, as the SAX interface reported it: enough for "must be X, not <this>"
// messages without keeping the value.
struct ValueDesc {
  enum Kind : uint8_t { kNull, kBoolean, kSigned, kUnsigned, kFloat, kString, kArray, kObject, kBinary };
  Kind kind = kNull;
  int64_t i = 0;  // kSigned
  double d = 0;   // kFloat
};

// The phrase a DOM's type_name() and dump() would give. Never throws.
std::string Describe(const ValueDesc& v) {
  switch (v.kind) {
    // nlohmann reads non-negative integers as unsigned; a signed one is negative (or "-0").
    case ValueDesc::kSigned: return (v.i < 0 ? "negative integer " : "signed integer ") + std::to_string(v.i);
    case ValueDesc::kFloat: return "number " + Json(v.d).dump() + " (not an unsigned 64-bit integer)";
    case ValueDesc::kUnsigned: return "number";
    case ValueDesc::kString: return "string";
    case ValueDesc::kBoolean: return "boolean";
    case ValueDesc::kArray: return "array";
    case ValueDesc::kObject: return "object";
    case ValueDesc::kBinary: return "binary";
    case ValueDesc::kNull: break;
  }
  return "null";
}

Status Corrupt(std::string message) {
  return Status::Corruption("safetensors header: " + std::move(message));
}

Status TensorCorrupt(std::string_view name, std::string message) {
  return Corrupt("tensor " + Quote(name) + ": " + std::move(message));
}

uint64_t LoadLE64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void StoreLE64(uint64_t v, uint8_t* p) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

// Byte size of a tensor: product(shape) * DTypeSize(dt). Returns false when the product of the
// non-zero dimensions times the element size overflows u64 -- even if another dimension is 0 --
// so that every stride a codec derives from an accepted shape fits in 64 bits.
bool ShapeByteSize(const std::vector<uint64_t>& shape, DType dt, uint64_t* bytes) {
  uint64_t nonzero = DTypeSize(dt);
  bool empty = false;
  for (uint64_t d : shape) {
    if (d == 0) {
      empty = true;
    } else if (__builtin_mul_overflow(nonzero, d, &nonzero)) {
      return false;
    }
  }
  *bytes = empty ? 0 : nonzero;
  return true;
}

// Rejects JSON that nests containers deeper than kMaxJsonDepth. A lexical scan that only
// tracks strings and brackets: exact for valid JSON; on invalid JSON it may report depth
// instead of the syntax error, which is a rejection either way.
Status CheckNestingDepth(std::string_view json) {
  int depth = 0;
  bool in_string = false;
  bool escaped = false;
  for (size_t i = 0; i < json.size(); ++i) {
    const char c = json[i];
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > kMaxJsonDepth) {
        return Corrupt("JSON nests deeper than " + std::to_string(kMaxJsonDepth) +
                       " levels at header byte " + std::to_string(i));
      }
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return Status::Ok();
}

// One top-level entry of the header as it was read: a tensor's fields, or __metadata__'s
// entries. What is kept of a field is what its checks need (its value, or what it was instead).
struct Entry {
  std::string key;
  ValueDesc value;  // the entry's own value: kObject for a well-formed one
  // A tensor entry's fields. `*_seen`: the field is present; its ValueDesc says what it was.
  bool dtype_seen = false, shape_seen = false, offsets_seen = false;
  ValueDesc dtype_value, shape_value, offsets_value;
  std::string dtype;
  std::vector<uint64_t> shape;
  std::optional<std::pair<size_t, ValueDesc>> bad_dim;  // the first element that is not a u64
  size_t offsets_count = 0;
  uint64_t offsets[2] = {0, 0};
  std::optional<ValueDesc> bad_offset[2];
  std::optional<std::string> unexpected;  // the smallest field name that is none of the three
  // __metadata__'s entries, and the smallest key whose value is not a string.
  std::map<std::string, std::string> metadata;
  std::optional<std::pair<std::string, ValueDesc>> bad_metadata;
};

// Validates one tensor entry on its own: fields, dtype, shape, offsets inside the data
// section of `data_size` bytes, and size. Tiling against the other tensors is checked later.
// The checks (and so the error a damaged entry gets) come in the order a DOM walk of the entry
// would make them: fields in sorted order, then dtype, shape, data_offsets.
Status CheckTensor(Entry& e, uint64_t data_size, TensorInfo* out) {
  const std::string& name = e.key;
  if (name.empty()) return Corrupt("a tensor has an empty name");
  if (e.value.kind != ValueDesc::kObject) {
    return TensorCorrupt(
        name, "entry must be an object with dtype, shape and data_offsets, not " + Describe(e.value));
  }
  if (e.unexpected) {
    return TensorCorrupt(name, "unexpected field " + Quote(*e.unexpected) +
                                   " (an entry has exactly dtype, shape and data_offsets)");
  }
  if (!e.dtype_seen) return TensorCorrupt(name, "missing field 'dtype'");
  if (!e.shape_seen) return TensorCorrupt(name, "missing field 'shape'");
  if (!e.offsets_seen) return TensorCorrupt(name, "missing field 'data_offsets'");

  if (e.dtype_value.kind != ValueDesc::kString) {
    return TensorCorrupt(name, "dtype must be a string, not " + Describe(e.dtype_value));
  }
  const std::optional<DType> dt = ParseDType(e.dtype);
  if (!dt) return TensorCorrupt(name, "unknown dtype " + Quote(e.dtype));

  if (e.shape_value.kind != ValueDesc::kArray) {
    return TensorCorrupt(name, "shape must be an array of non-negative integers, not " +
                                   Describe(e.shape_value));
  }
  if (e.bad_dim) {
    return TensorCorrupt(name, "shape[" + std::to_string(e.bad_dim->first) +
                                   "] must be a non-negative integer, not " +
                                   Describe(e.bad_dim->second));
  }

  if (e.offsets_value.kind != ValueDesc::kArray) {
    return TensorCorrupt(name, "data_offsets must be an array [begin, end], not " +
                                   Describe(e.offsets_value));
  }
  if (e.offsets_count != 2) {
    return TensorCorrupt(name, "data_offsets has " + std::to_string(e.offsets_count) +
                                   " entries; expected 2 ([begin, end])");
  }
  for (size_t i = 0; i < 2; ++i) {
    if (e.bad_offset[i]) {
      return TensorCorrupt(name, "data_offsets[" + std::to_string(i) +
                                     "] must be a non-negative integer, not " +
                                     Describe(*e.bad_offset[i]));
    }
  }
  const uint64_t begin = e.offsets[0], end = e.offsets[1];
  if (begin > end) {
    return TensorCorrupt(name, "data_offsets " + Range(begin, end) + " are reversed (begin > end)");
  }
  if (end > data_size) {
    return TensorCorrupt(name, "data_offsets " + Range(begin, end) +
                                   " run past the end of the data section (" +
                                   std::to_string(data_size) + " bytes)");
  }
  uint64_t bytes = 0;
  if (!ShapeByteSize(e.shape, *dt, &bytes)) {
    return TensorCorrupt(name, "shape " + FormatShape(e.shape) + " of " + e.dtype +
                                   " overflows 64 bits");
  }
  if (bytes != end - begin) {
    return TensorCorrupt(name, "size mismatch: shape " + FormatShape(e.shape) + " of " +
                                   e.dtype + " is " + std::to_string(bytes) +
                                   " bytes but data_offsets " + Range(begin, end) + " span " +
                                   std::to_string(end - begin) + " bytes");
  }
  out->name = std::move(e.key);
  out->dtype = *dt;
  out->shape = std::move(e.shape);
  out->begin = begin;
  out->end = end;
  return Status::Ok();
}

Status CheckMetadata(const Entry& e) {
  if (e.value.kind != ValueDesc::kObject) {
    return Corrupt("__metadata__ must be an object of string to string, not " + Describe(e.value));
  }
  if (e.bad_metadata) {
    return Corrupt("__metadata__ key " + Quote(e.bad_metadata->first) +
                   " must have a string value, not " + Describe(e.bad_metadata->second));
  }
  return Status::Ok();
}

// The SAX handler that reads the header straight into TensorInfos: no DOM (a DOM costs ~1 KiB
// per tensor), a hash-set insert per key. It reports what a DOM reader would, in the same
// order: a JSON syntax error anywhere; else the first repeated key in document order (nlohmann's
// DOM keeps the last of duplicate keys without a word, and two readers could pick different
// answers, so repeats among the top-level keys and among the keys of each tensor entry /
// __metadata__ are errors); else, of the entries that fail their own checks, the one whose key
// sorts first (a DOM walks its object in key order); else the tiling of the data section.
//
// Depth counts the containers open around an event: 1 inside the top-level object, 2 inside an
// entry, 3 inside a field's array. CheckNestingDepth has made sure nothing is deeper.
class HeaderReader {
 public:
  explicit HeaderReader(uint64_t data_size) : data_size_(data_size) {}

  bool null() { return Value({ValueDesc::kNull}); }
  bool boolean(bool) { return Value({ValueDesc::kBoolean}); }
  bool number_integer(Json::number_integer_t v) { return Value({ValueDesc::kSigned, v}); }
  bool number_unsigned(Json::number_unsigned_t v) {
    unsigned_ = v;
    return Value({ValueDesc::kUnsigned});
  }
  bool number_float(Json::number_float_t v, const Json::string_t&) {
    return Value({ValueDesc::kFloat, 0, v});
  }
  bool string(Json::string_t& v) {
    string_ = &v;
    return Value({ValueDesc::kString});
  }
  bool binary(Json::binary_t&) { return Value({ValueDesc::kBinary}); }
  bool start_object(std::size_t) { return Open(ValueDesc::kObject); }
  bool start_array(std::size_t) { return Open(ValueDesc::kArray); }
  bool end_object() { return Close(); }
  bool end_array() { return Close(); }

  bool key(Json::string_t& key) {
    if (depth_ == 1) {
      if (duplicate_) return true;
      // A new entry. (A key of the top level is always followed by its value.)
      if (!outer_keys_.insert(key).second) {
        duplicate_ = Corrupt("duplicate key " + Quote(key) + " at the top level");
        return true;
      }
      entry_ = Entry{};
      entry_.key = key;
    } else if (depth_ == 2) {
      if (duplicate_) return true;
      if (!inner_keys_.insert(key).second) {
        duplicate_ = entry_.key == kMetadataKey
                         ? Corrupt("duplicate key " + Quote(key) + " in __metadata__")
                         : TensorCorrupt(entry_.key, "duplicate key " + Quote(key) + " in its entry");
        return true;
      }
      field_ = key;
    }
    return true;
  }

  template <class Exception>
  bool parse_error(std::size_t position, const std::string&, const Exception& ex) {
    std::string_view what = ex.what();
    // Drop nlohmann's "[json.exception.parse_error.101] " tag; cap the quoted token.
    if (const size_t tag = what.find("] "); tag != std::string_view::npos) {
      what.remove_prefix(tag + 2);
    }
    constexpr size_t kMaxWhat = 200;
    json_error_ = "at header byte " + std::to_string(position) + ": ";
    AppendEscaped(what.substr(0, kMaxWhat), /*ascii_only=*/true, &json_error_);
    if (what.size() > kMaxWhat) json_error_ += "...";
    return false;
  }

  // The first finding (see the class comment), or OK with the tensors (in document order) and
  // the metadata moved into *header.
  Status Finish(bool parsed, SafetensorsHeader* header) {
    if (!parsed) {
      return Corrupt("header is not valid JSON (or not UTF-8) " +
                     (json_error_.empty() ? std::string("unknown JSON error") : json_error_));
    }
    if (duplicate_) return *duplicate_;
    if (error_) return error_->second;
    header->tensors = std::move(tensors_);
    header->metadata = std::move(metadata_);
    return Status::Ok();
  }

 private:
  bool Value(const ValueDesc& v) {
    if (duplicate_) return true;
    if (depth_ == 1) {  // an entry that is not a container
      entry_.value = v;
      FinishEntry();
    } else if (depth_ == 2 && in_entry_object_) {
      Field(v);
    } else if (depth_ == 3 && field_is_array_) {
      Element(v);
    }
    return true;
  }

  bool Open(ValueDesc::Kind kind) {
    if (depth_ == 1) {
      // An entry: a tensor or __metadata__. clear() costs the bucket count, which one huge
      // entry would leave large for every entry after it.
      if (kind == ValueDesc::kObject) {
        if (inner_keys_.bucket_count() > 64) {
          inner_keys_ = {};
        } else {
          inner_keys_.clear();
        }
      }
      entry_.value = {kind};
      in_entry_object_ = kind == ValueDesc::kObject;
    } else if (depth_ == 2 && in_entry_object_ && !duplicate_) {
      Field({kind});
      field_is_array_ = kind == ValueDesc::kArray;
    }
    ++depth_;
    return true;
  }

  bool Close() {
    --depth_;
    if (depth_ == 2) field_is_array_ = false;
    if (depth_ == 1) {
      in_entry_object_ = false;
      if (!duplicate_) FinishEntry();
    }
    return true;
  }

  // The value of field `field_` of the current entry (a container's kind, for a container).
  void Field(const ValueDesc& v) {
    Entry& e = entry_;
    if (e.key == kMetadataKey) {
      if (v.kind == ValueDesc::kString) {
        e.metadata.emplace(field_, std::move(*string_));
      } else if (!e.bad_metadata || field_ < e.bad_metadata->first) {
        e.bad_metadata.emplace(field_, v);
      }
      return;
    }
    if (field_ == "dtype") {
      e.dtype_seen = true;
      e.dtype_value = v;
      if (v.kind == ValueDesc::kString) e.dtype = std::move(*string_);
    } else if (field_ == "shape") {
      e.shape_seen = true;
      e.shape_value = v;
    } else if (field_ == "data_offsets") {
      e.offsets_seen = true;
      e.offsets_value = v;
    } else if (!e.unexpected || field_ < *e.unexpected) {
      e.unexpected = field_;
    }
  }

  // An element of the array in field `field_`.
  void Element(const ValueDesc& v) {
    Entry& e = entry_;
    if (e.key == kMetadataKey) return;
    if (field_ == "shape") {
      if (v.kind == ValueDesc::kUnsigned) {
        if (!e.bad_dim) e.shape.push_back(unsigned_);
      } else if (!e.bad_dim) {
        e.bad_dim.emplace(e.shape.size(), v);
      }
    } else if (field_ == "data_offsets") {
      const size_t i = e.offsets_count++;
      if (i < 2) {
        if (v.kind == ValueDesc::kUnsigned) {
          e.offsets[i] = unsigned_;
        } else {
          e.bad_offset[i] = v;
        }
      }
    }
  }

  void FinishEntry() {
    Status s;
    if (entry_.key == kMetadataKey) {
      s = CheckMetadata(entry_);
      if (s.ok()) metadata_ = std::move(entry_.metadata);
    } else {
      TensorInfo t;
      s = CheckTensor(entry_, data_size_, &t);
      if (s.ok() && !error_) tensors_.push_back(std::move(t));
    }
    if (!s.ok() && (!error_ || entry_.key < error_->first)) {
      if (!error_) tensors_ = {};  // the header fails: what it holds is not needed any more
      error_.emplace(std::move(entry_.key), std::move(s));
    }
  }

  const uint64_t data_size_;
  int depth_ = 0;
  std::string json_error_;
  std::optional<Status> duplicate_;  // the first repeated key: nothing after it is read
  std::unordered_set<std::string> outer_keys_;
  std::unordered_set<std::string> inner_keys_;  // of the current entry
  Entry entry_;
  bool in_entry_object_ = false;
  std::string field_;            // the current entry's current field
  bool field_is_array_ = false;  // and its value is an array (depth 3 holds its elements)
  uint64_t unsigned_ = 0;        // the last number_unsigned
  Json::string_t* string_ = nullptr;  // the last string (ours to move from)
  std::optional<std::pair<std::string, Status>> error_;  // the failing entry whose key sorts first
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// REQUIRES: `tensors` sorted by (begin, end, name), each inside [0, data_size).
Status CheckTiling(const std::vector<TensorInfo>& tensors, uint64_t data_size,
                   uint64_t file_size) {
  uint64_t cursor = 0;
  const TensorInfo* prev = nullptr;
  for (const TensorInfo& t : tensors) {
    if (t.begin > cursor) {
      return TensorCorrupt(
          t.name, "data_offsets " + Range(t.begin, t.end) + " leave a gap: data section bytes " +
                      Range(cursor, t.begin) + " after " +
                      (prev != nullptr ? "tensor " + Quote(prev->name) : std::string("its start")) +
                      " belong to no tensor");
    }
    if (t.begin < cursor) {
      // prev is non-null: cursor > 0 only after a tensor; sorted order makes prev->end == cursor.
      return TensorCorrupt(t.name, "data_offsets " + Range(t.begin, t.end) + " overlap tensor " +
                                       Quote(prev->name) + " at " + Range(prev->begin, prev->end));
    }
    cursor = t.end;
    prev = &t;
  }
  if (cursor != data_size) {
    return Corrupt("tensors end at data section byte " + std::to_string(cursor) +
                   " but the data section has " + std::to_string(data_size) + " bytes (file size " +
                   std::to_string(file_size) +
                   "); the data section must end exactly at the end of the file");
  }
  return Status::Ok();
}

Expected<SafetensorsHeader> Parse(std::span<const uint8_t> prefix, uint64_t file_size) {
  WFS_ASSIGN_OR_RETURN(const uint64_t prefix_length, SafetensorsPrefixLength(prefix));
  const uint64_t n = prefix_length - kLengthBytes;
  if (prefix_length > file_size) {
    return Corrupt("header length " + std::to_string(n) + " needs " +
                   std::to_string(prefix_length) + " bytes but the file size is only " +
                   std::to_string(file_size));
  }
  if (prefix_length > prefix.size()) {
    return Corrupt("truncated prefix: header length " + std::to_string(n) + " needs the first " +
                   std::to_string(prefix_length) + " bytes of the file but only " +
                   std::to_string(prefix.size()) + " were given");
  }
  const std::string_view json(reinterpret_cast<const char*>(prefix.data()) + kLengthBytes, n);
  if (json.front() != '{') {
    return Corrupt("header JSON must start with '{', found byte " +
                   Quote(json.substr(0, 1)));
  }
  // nlohmann's lexer takes a NUL byte for the end of input, so "{}\0<anything>" would parse.
  // A raw NUL is never valid JSON (not whitespace; unescaped inside a string), so reject it.
  if (const size_t nul = json.find('\0'); nul != std::string_view::npos) {
    return Corrupt("header is not valid JSON: NUL byte at header byte " + std::to_string(nul));
  }
  WFS_TRY(CheckNestingDepth(json));

  SafetensorsHeader header;
  header.header_size = n;
  header.data_offset = prefix_length;
  header.file_size = file_size;
  const uint64_t data_size = file_size - prefix_length;
  HeaderReader reader(data_size);
  WFS_TRY(reader.Finish(Json::sax_parse(json.data(), json.data() + json.size(), &reader), &header));
  // By begin; among equal begins zero-size tensors first (the only way several tensors can
  // share a begin in a valid file), then by name so the order is total and deterministic.
  std::sort(header.tensors.begin(), header.tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) {
              return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
            });
  WFS_TRY(CheckTiling(header.tensors, data_size, file_size));
  return header;
}

}  // namespace

Expected<uint64_t> SafetensorsPrefixLength(std::span<const uint8_t> prefix) {
  if (prefix.size() < kLengthBytes) {
    return Corrupt("truncated prefix: " + std::to_string(prefix.size()) +
                   " bytes, need 8 for the header length");
  }
  const uint64_t n = LoadLE64(prefix.data());
  if (n == 0) return Corrupt("header length is 0");
  if (n > kMaxSafetensorsHeaderBytes) {
    return Corrupt("header length " + std::to_string(n) + " exceeds the limit of " +
                   std::to_string(kMaxSafetensorsHeaderBytes) + " bytes");
  }
  return kLengthBytes + n;
}

Expected<SafetensorsHeader> ParseSafetensorsHeader(std::span<const uint8_t> prefix,
                                                   uint64_t file_size) {
  // The SAX reader gives nlohmann nothing to throw about; the catches keep a missed case or an
  // allocation failure on a huge header from unwinding through a FUSE callback. The fuzz
  // target treats reaching the second one as a bug.
  try {
    return Parse(prefix, file_size);
  } catch (const std::bad_alloc&) {
    return Status::ResourceExhausted("safetensors header: out of memory parsing a " +
                                     std::to_string(prefix.size()) + "-byte prefix");
  } catch (const nlohmann::json::exception& e) {
    return Corrupt(std::string("unexpected JSON exception: ") + e.what());
  }
}

Expected<std::optional<SafetensorsHeader>> CheckSafetensors(std::string_view path, std::span<const uint8_t> file,
                                                            uint64_t file_size) {
  constexpr std::string_view kSuffix = ".safetensors";
  const bool named = path.size() >= kSuffix.size() && path.substr(path.size() - kSuffix.size()) == kSuffix;
  const uint64_t n = file.size() >= kLengthBytes ? LoadLE64(file.data()) : 0;
  const bool looks = file.size() > kLengthBytes && n >= 2 && n <= kMaxSafetensorsHeaderBytes &&
                     n <= file_size - kLengthBytes && file[kLengthBytes] == '{';
  // Parsed whenever its first bytes allow, as PlanFile does: why it is not safetensors matters
  // only for a file that claims to be.
  Status why;
  if (file_size < kLengthBytes) {
    why = Status::Corruption("it is " + std::to_string(file_size) +
                             " bytes long, shorter than the 8-byte header length: truncated?");
  } else if (Expected<uint64_t> prefix = SafetensorsPrefixLength(file); !prefix.ok()) {
    why = prefix.status();
  } else if (*prefix > file_size) {
    why = Status::Corruption("its header length says " + std::to_string(*prefix - kLengthBytes) +
                             " bytes of JSON, and the file has " + std::to_string(file_size) + " bytes: truncated?");
  } else if (*prefix > file.size()) {
    return std::optional<SafetensorsHeader>();  // (the caller has not read the header: no verdict)
  } else if (Expected<SafetensorsHeader> header = ParseSafetensorsHeader(file, file_size); header.ok()) {
    return std::optional<SafetensorsHeader>(std::move(header).value());
  } else {
    why = header.status();
  }
  if (!named && !looks) return std::optional<SafetensorsHeader>();
  std::string reason(why.message());
  if (reason.rfind("safetensors header: ", 0) == 0) reason = "its header: " + reason.substr(20);
  return Status::InvalidArgument(std::string(path) + " is not a valid safetensors file (" +
                                 (named ? "by its name" : "by its first bytes") + "): " + reason);
}

// REQUIRES (checked by assert only, uniqueness not at all; the reader rejects the result
// otherwise): tensor names are unique, non-empty and not "__metadata__"; dtypes are not kOpaque;
// every byte size and their sum fit in u64. Names that are not valid UTF-8 are written with
// U+FFFD replacements rather than throwing.
std::vector<uint8_t> BuildSafetensorsHeader(std::vector<TensorInfo>& tensors,
                                            const std::map<std::string, std::string>& metadata) {
  using OrderedJson = nlohmann::ordered_json;
  // The object is written entry by entry, in insertion order: __metadata__ first, then tensors
  // in file order, which is what the reference writer produces and what a human reading the
  // header expects. (An ordered_json object looks every key up linearly on insertion: quadratic
  // in the tensors.)
  std::string json = "{";
  auto add = [&json](const std::string& key, const OrderedJson& value) {
    if (json.size() > 1) json += ',';
    json += OrderedJson(key).dump(-1, ' ', false, OrderedJson::error_handler_t::replace);
    json += ':';
    json += value.dump(-1, ' ', false, OrderedJson::error_handler_t::replace);
  };
  if (!metadata.empty()) add(std::string(kMetadataKey), OrderedJson(metadata));
  uint64_t offset = 0;
  for (TensorInfo& t : tensors) {
    assert(t.dtype != DType::kOpaque && !t.name.empty() && t.name != kMetadataKey);
    uint64_t bytes = 0;
    [[maybe_unused]] const bool fits = ShapeByteSize(t.shape, t.dtype, &bytes);
    assert(fits);
    t.begin = offset;
    [[maybe_unused]] const bool overflow = __builtin_add_overflow(offset, bytes, &t.end);
    assert(!overflow);
    offset = t.end;

    OrderedJson entry = OrderedJson::object();
    entry["dtype"] = std::string(DTypeName(t.dtype));
    entry["shape"] = t.shape;
    entry["data_offsets"] = OrderedJson::array({t.begin, t.end});
    add(t.name, entry);
  }
  json += '}';

  const size_t padding = (8 - (kLengthBytes + json.size()) % 8) % 8;
  const uint64_t n = json.size() + padding;
  std::vector<uint8_t> out(kLengthBytes + n, ' ');
  StoreLE64(n, out.data());
  std::memcpy(out.data() + kLengthBytes, json.data(), json.size());
  return out;
}

}  // namespace weightfs
