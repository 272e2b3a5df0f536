// Content hashes.
//
// Hash128 is the identity of a chunk's materialized bytes: XXH3-128 (libxxhash). Why XXH3-128:
// it runs at memory bandwidth (~20+ GB/s per core here) so verifying every chunk before a reader
// sees it costs almost nothing next to decoding, and 128 bits make accidental collisions
// irrelevant at any realistic chunk count (10^5..10^9). It is not a cryptographic hash: chunk
// hashes detect corruption and identify content inside buckets the user controls; whole files
// get SHA-256 (below), the identity the Hub and `sha256sum` use.
//
// Sha256 is incremental and backed by OpenSSL's EVP (SHA-NI where the CPU has it).
// All functions are thread-safe; a Sha256 object is not (use one per thread).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "core/status.h"

namespace weightfs {

struct Hash128 {
  uint64_t hi = 0;
  uint64_t lo = 0;
  bool operator==(const Hash128&) const = default;
  auto operator<=>(const Hash128&) const = default;
  // 32 lowercase hex digits, hi first.
  std::string ToHex() const;
  static Expected<Hash128> FromHex(std::string_view hex);
};

Hash128 HashChunk(std::span<const uint8_t> bytes);
// XXH3-64, used inside codec payloads as a cheap self-check.
uint64_t Hash64(std::span<const uint8_t> bytes);

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  void Update(std::span<const uint8_t> bytes);
  // Returns the digest as 64 lowercase hex digits. The object cannot be updated afterwards.
  std::string FinishHex();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

std::string Sha256Hex(std::span<const uint8_t> bytes);

}  // namespace weightfs
