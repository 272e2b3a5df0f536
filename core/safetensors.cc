#include "core/safetensors.h"

#include <algorithm>
#include <cassert>
#include <cstring>
#include <new>
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

// What a JSON value is, for "must be X, not <this>" messages. Never throws.
std::string Describe(const Json& v) {
  if (const auto* i = v.get_ptr<const Json::number_integer_t*>()) {
    // nlohmann stores non-negative integers as unsigned; a signed one is negative (or "-0").
    return (*i < 0 ? "negative integer " : "signed integer ") + std::to_string(*i);
  }
  if (v.is_number_float()) return "number " + v.dump() + " (not an unsigned 64-bit integer)";
  return v.type_name();
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

// One SAX pass over the header before the DOM is built: the parser's error message when the
// JSON does not parse (the DOM parse, with exceptions off, does not say why), and the first
// repeated key. nlohmann::json keeps the last of duplicate object keys without a word; a file
// whose tensor appears twice (or whose entry names "dtype" twice) is ambiguous, and two readers
// could pick different answers. This records the first duplicate, in document order, among the
// top-level keys and among the keys of each tensor entry / __metadata__. Deeper objects cannot
// occur in a valid header and are rejected later anyway.
//
// Linear in the header: a key costs a hash-set insert. (The parser callback this replaces made
// nlohmann's callback parser scan the whole top-level object after every tensor entry: 32k
// tensors took 49 s, 70k never finished.)
class HeaderScan {
 public:
  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(Json::number_integer_t) { return true; }
  bool number_unsigned(Json::number_unsigned_t) { return true; }
  bool number_float(Json::number_float_t, const Json::string_t&) { return true; }
  bool string(Json::string_t&) { return true; }
  bool binary(Json::binary_t&) { return true; }
  bool start_object(std::size_t) {
    if (depth_ == 1) {
      // A new tensor entry or __metadata__. clear() costs the bucket count, which one huge
      // entry would leave large for every entry after it.
      if (inner_keys_.bucket_count() > 64) {
        inner_keys_ = {};
      } else {
        inner_keys_.clear();
      }
    }
    ++depth_;
    return true;
  }
  bool start_array(std::size_t) {
    ++depth_;
    return true;
  }
  bool end_object() {
    --depth_;
    return true;
  }
  bool end_array() {
    --depth_;
    return true;
  }
  bool key(Json::string_t& key) {
    if (found_ || (depth_ != 1 && depth_ != 2)) return true;
    auto& keys = depth_ == 1 ? outer_keys_ : inner_keys_;
    if (!keys.insert(key).second) {
      found_ = true;
      duplicate_ = key;
      at_top_level_ = depth_ == 1;
      parent_ = last_outer_key_;
    } else if (depth_ == 1) {
      last_outer_key_ = key;
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

  // The first finding, in the order a reader must report them: the JSON does not parse, then a
  // repeated key. OK if neither.
  Status ToStatus(bool parsed) const {
    if (!parsed) {
      return Corrupt("header is not valid JSON (or not UTF-8) " +
                     (json_error_.empty() ? std::string("unknown JSON error") : json_error_));
    }
    if (!found_) return Status::Ok();
    if (at_top_level_) return Corrupt("duplicate key " + Quote(duplicate_) + " at the top level");
    if (parent_ == kMetadataKey) {
      return Corrupt("duplicate key " + Quote(duplicate_) + " in __metadata__");
    }
    return TensorCorrupt(parent_, "duplicate key " + Quote(duplicate_) + " in its entry");
  }

 private:
  int depth_ = 0;  // containers open around the current event
  std::string json_error_;
  bool found_ = false;
  std::string duplicate_;
  bool at_top_level_ = false;
  std::string parent_;  // the top-level key whose object holds the duplicate
  std::string last_outer_key_;
  std::unordered_set<std::string> outer_keys_;
  std::unordered_set<std::string> inner_keys_;
};

Status ParseMetadata(const Json& value, std::map<std::string, std::string>* metadata) {
  const auto* entries = value.get_ptr<const Json::object_t*>();
  if (entries == nullptr) {
    return Corrupt("__metadata__ must be an object of string to string, not " + Describe(value));
  }
  for (const auto& [key, v] : *entries) {
    const auto* s = v.get_ptr<const Json::string_t*>();
    if (s == nullptr) {
      return Corrupt("__metadata__ key " + Quote(key) + " must have a string value, not " +
                     Describe(v));
    }
    metadata->emplace(key, *s);
  }
  return Status::Ok();
}

// Reads data_offsets[i] into *out.
Status ParseOffset(const std::string& name, const Json::array_t& offsets, size_t i,
                   uint64_t* out) {
  const auto* v = offsets[i].get_ptr<const Json::number_unsigned_t*>();
  if (v == nullptr) {
    return TensorCorrupt(name, "data_offsets[" + std::to_string(i) +
                                   "] must be a non-negative integer, not " +
                                   Describe(offsets[i]));
  }
  *out = *v;
  return Status::Ok();
}

// Validates one tensor entry on its own: fields, dtype, shape, offsets inside the data
// section of `data_size` bytes, and size. Tiling against the other tensors is checked later.
Status ParseTensor(const std::string& name, const Json& value, uint64_t data_size,
                   TensorInfo* out) {
  if (name.empty()) return Corrupt("a tensor has an empty name");
  const auto* fields = value.get_ptr<const Json::object_t*>();
  if (fields == nullptr) {
    return TensorCorrupt(
        name, "entry must be an object with dtype, shape and data_offsets, not " + Describe(value));
  }
  const Json* dtype = nullptr;
  const Json* shape = nullptr;
  const Json* offsets = nullptr;
  for (const auto& [field, v] : *fields) {
    if (field == "dtype") {
      dtype = &v;
    } else if (field == "shape") {
      shape = &v;
    } else if (field == "data_offsets") {
      offsets = &v;
    } else {
      return TensorCorrupt(name, "unexpected field " + Quote(field) +
                                     " (an entry has exactly dtype, shape and data_offsets)");
    }
  }
  if (dtype == nullptr) return TensorCorrupt(name, "missing field 'dtype'");
  if (shape == nullptr) return TensorCorrupt(name, "missing field 'shape'");
  if (offsets == nullptr) return TensorCorrupt(name, "missing field 'data_offsets'");

  out->name = name;

  const auto* dtype_name = dtype->get_ptr<const Json::string_t*>();
  if (dtype_name == nullptr) {
    return TensorCorrupt(name, "dtype must be a string, not " + Describe(*dtype));
  }
  const std::optional<DType> dt = ParseDType(*dtype_name);
  if (!dt) return TensorCorrupt(name, "unknown dtype " + Quote(*dtype_name));
  out->dtype = *dt;

  const auto* dims = shape->get_ptr<const Json::array_t*>();
  if (dims == nullptr) {
    return TensorCorrupt(name, "shape must be an array of non-negative integers, not " +
                                   Describe(*shape));
  }
  out->shape.reserve(dims->size());
  for (size_t i = 0; i < dims->size(); ++i) {
    const auto* d = (*dims)[i].get_ptr<const Json::number_unsigned_t*>();
    if (d == nullptr) {
      return TensorCorrupt(name, "shape[" + std::to_string(i) +
                                     "] must be a non-negative integer, not " +
                                     Describe((*dims)[i]));
    }
    out->shape.push_back(*d);
  }

  const auto* range = offsets->get_ptr<const Json::array_t*>();
  if (range == nullptr) {
    return TensorCorrupt(name, "data_offsets must be an array [begin, end], not " +
                                   Describe(*offsets));
  }
  if (range->size() != 2) {
    return TensorCorrupt(name, "data_offsets has " + std::to_string(range->size()) +
                                   " entries; expected 2 ([begin, end])");
  }
  WFS_TRY(ParseOffset(name, *range, 0, &out->begin));
  WFS_TRY(ParseOffset(name, *range, 1, &out->end));
  if (out->begin > out->end) {
    return TensorCorrupt(name, "data_offsets " + Range(out->begin, out->end) +
                                   " are reversed (begin > end)");
  }
  if (out->end > data_size) {
    return TensorCorrupt(name, "data_offsets " + Range(out->begin, out->end) +
                                   " run past the end of the data section (" +
                                   std::to_string(data_size) + " bytes)");
  }

  uint64_t bytes = 0;
  if (!ShapeByteSize(out->shape, out->dtype, &bytes)) {
    return TensorCorrupt(name, "shape " + FormatShape(out->shape) + " of " + *dtype_name +
                                   " overflows 64 bits");
  }
  if (bytes != out->size()) {
    return TensorCorrupt(name, "size mismatch: shape " + FormatShape(out->shape) + " of " +
                                   *dtype_name + " is " + std::to_string(bytes) +
                                   " bytes but data_offsets " + Range(out->begin, out->end) +
                                   " span " + std::to_string(out->size()) + " bytes");
  }
  return Status::Ok();
}

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

  HeaderScan scan;
  WFS_TRY(scan.ToStatus(Json::sax_parse(json.data(), json.data() + json.size(), &scan)));
  const Json root = Json::parse(json.data(), json.data() + json.size(), nullptr,
                                /*allow_exceptions=*/false);
  if (root.is_discarded()) return Corrupt("header is not valid JSON (or not UTF-8)");  // parsed above
  const auto* top = root.get_ptr<const Json::object_t*>();
  if (top == nullptr) return Corrupt("header JSON must be an object, not " + Describe(root));

  SafetensorsHeader header;
  header.header_size = n;
  header.data_offset = prefix_length;
  header.file_size = file_size;
  const uint64_t data_size = file_size - prefix_length;
  header.tensors.reserve(top->size());
  for (const auto& [key, value] : *top) {
    if (key == kMetadataKey) {
      WFS_TRY(ParseMetadata(value, &header.metadata));
      continue;
    }
    TensorInfo tensor;
    WFS_TRY(ParseTensor(key, value, data_size, &tensor));
    header.tensors.push_back(std::move(tensor));
  }
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
  // Every accessor above is type-checked (get_ptr), so nlohmann has nothing to throw; the
  // catches keep a missed case or an allocation failure on a huge header from unwinding
  // through a FUSE callback. The fuzz target treats reaching the second one as a bug.
  try {
    return Parse(prefix, file_size);
  } catch (const std::bad_alloc&) {
    return Status::ResourceExhausted("safetensors header: out of memory parsing a " +
                                     std::to_string(prefix.size()) + "-byte prefix");
  } catch (const nlohmann::json::exception& e) {
    return Corrupt(std::string("unexpected JSON exception: ") + e.what());
  }
}

// REQUIRES (checked by assert only; the reader rejects the result otherwise): tensor names are
// unique, non-empty and not "__metadata__"; dtypes are not kOpaque; every byte size and their
// sum fit in u64. Names that are not valid UTF-8 are written with U+FFFD replacements rather
// than throwing.
std::vector<uint8_t> BuildSafetensorsHeader(std::vector<TensorInfo>& tensors,
                                            const std::map<std::string, std::string>& metadata) {
  using OrderedJson = nlohmann::ordered_json;
  // ordered_json keeps insertion order: __metadata__ first, then tensors in file order, which
  // is what the reference writer produces and what a human reading the header expects.
  OrderedJson header = OrderedJson::object();
  if (!metadata.empty()) header[std::string(kMetadataKey)] = metadata;
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
    [[maybe_unused]] const size_t before = header.size();
    header[t.name] = std::move(entry);
    assert(header.size() == before + 1 && "duplicate tensor name");
  }

  const std::string json = header.dump(-1, ' ', false, OrderedJson::error_handler_t::replace);
  const size_t padding = (8 - (kLengthBytes + json.size()) % 8) % 8;
  const uint64_t n = json.size() + padding;
  std::vector<uint8_t> out(kLengthBytes + n, ' ');
  StoreLE64(n, out.data());
  std::memcpy(out.data() + kLengthBytes, json.data(), json.size());
  return out;
}

}  // namespace weightfs
