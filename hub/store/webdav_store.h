// WebDavStore: a bucket on a plain HTTP(S) server that speaks WebDAV (RFC 4918): nginx with
// the dav and dav-ext modules, Apache mod_dav, rclone serve webdav, ...
//
// URL: `http://host[:port]/prefix` or `https://...`; `user:password@host` sends HTTP Basic
// credentials, which never appear in Describe(), logs or errors. Key K lives at
// `<prefix>/<K>` (percent-encoded); collections (directories) are created as needed.
//
// Operations:
//   Get    GET, with `Range: bytes=a-b` for ranges (a 206 answer or a 200 that is sliced).
//   Put    PUT to `<prefix>/.weightfs-tmp/<random>`, then MOVE to the key with `Overwrite: T`
//          (kOverwrite) or `Overwrite: F` (kCreateIfAbsent; 412 -> Conflict). Readers never see
//          a partial object. A MOVE retried after an attempt whose answer was lost comes back
//          404/412; whether the temporary still exists settles it (only this Put knows its
//          random name). A Put the server refuses deletes its temporary; one that could not
//          reach the server within the HttpClient's budget returns at once and may leave a
//          temporary behind (never listed; safe to delete). Collections are made with MKCOL
//          where PUT or MOVE need them (the temporary directory once per store).
//   Head   HEAD (Content-Length).
//   List   PROPFIND Depth: 1 from the deepest collection of the prefix, walking collections
//          in key order and stopping after one page; `.weightfs-tmp` is never listed.
//   ListTemporaries  PROPFIND Depth: 1 of `.weightfs-tmp/` (sizes and getlastmodified).
//   Delete DELETE with `Depth: 0` (a server must refuse it for a collection rather than
//          delete a tree); 404 -> NotFound (also when a retry follows an attempt that deleted
//          the object but whose answer was lost).
//
// Create-if-absent is exactly as atomic as the server's MOVE with `Overwrite: F`. nginx checks
// and renames within one event-loop step, which is atomic with one worker process; with
// several workers, two MOVEs racing within microseconds could both succeed.
//
// Thread-safe: any number of threads may call any method concurrently; all I/O goes through the
// (thread-safe) HttpClient and the only mutable state is an atomic flag.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "hub/store/http_client.h"
#include "hub/store/store.h"

namespace weightfs {

// A store for `url` that sends its requests through `http` (shared with other stores; nullptr:
// a client with default options). No request is made here: a wrong address shows up on the
// first operation. InvalidArgument for a URL that is not http(s)://host[:port][/prefix] or that
// has a query string.
Expected<std::unique_ptr<Store>> OpenWebDavStore(std::string_view url, std::shared_ptr<HttpClient> http);

// One <response> of a PROPFIND answer.
struct DavEntry {
  std::string href;  // as sent: a path or an absolute URL, percent-encoded (XML entities decoded)
  bool collection = false;
  std::optional<uint64_t> length;  // getcontentlength, when a 2xx propstat gave one
  std::optional<int64_t> modified_ms;  // getlastmodified (an HTTP date), when one gave a valid one
};

// The responses of a 207 multistatus document (RFC 4918 14.16) whose own status, if any, is
// 2xx; Corruption for malformed XML. Reads untrusted input: never aborts, bounded nesting.
// Exposed for tests and fuzzing; the store is its only other user.
Expected<std::vector<DavEntry>> ParseDavMultistatus(std::string_view xml);

}  // namespace weightfs
