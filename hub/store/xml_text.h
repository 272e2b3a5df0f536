// XML character data decoding shared by the stores that read XML answers (S3 listings and
// errors, WebDAV PROPFIND): the five predefined entities and numeric character references
// (&#65; &#x41;) become their characters, UTF-8 encoded. Anything else that looks like an
// entity (unknown names, NUL, surrogates, code points past U+10FFFF, unterminated) is kept
// literally: it cannot be a key we wrote, and a DTD's entities are never expanded.
// Pure functions; thread-safe.
#pragma once

#include <string>
#include <string_view>

namespace weightfs {

void AppendXmlText(std::string& out, std::string_view text);

inline std::string DecodeXmlText(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  AppendXmlText(out, text);
  return out;
}

}  // namespace weightfs
