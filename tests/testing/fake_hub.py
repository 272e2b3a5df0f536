#!/usr/bin/env python3
"""A local fake of the Hugging Face Hub endpoints weightfs uses (tests only; Python 3 stdlib).

    fake_hub.py --repos DIR [--s3 http://127.0.0.1:PORT] [--token T] [--gated ORG/REPO]
                [--page-size N] [--lfs-threshold BYTES] [--listen-port 0]
                [--bucket NS/NAME]... [--gateway-target URL] [--resolver-quota N] [--api-quota N]
                [--window SECONDS] [--time-scale K] [--url-ttl SECONDS]

Prints "PORT <hub> <cdn-url> <gateway-url>" as the first line of stdout once the listeners
accept connections (e.g. "PORT 41234 http://127.0.0.2:41235 http://127.0.0.1:41236"); logs (with
--verbose) go to stderr. Stops on SIGTERM/SIGINT.

Three listeners, the first two on purpose on different hosts:
  hub      127.0.0.1:<port>    the Hub API, resolve URLs, control endpoints
  cdn      127.0.0.2:<port2>   where LFS/bucket files redirect to (like cas-bridge.xethub.hf.co);
                               it records every Authorization header it receives, so tests can
                               assert the Hub token never reaches it. (Falls back to the host name
                               "localhost" on 127.0.0.1 when 127.0.0.2 cannot be bound.) Its URLs
                               are signed like the Hub's: X-Amz-Date + X-Amz-Expires (--url-ttl,
                               default 3600 s) and CloudFront's Expires=, HMAC-signed; an expired
                               or revoked (control revoke_urls=1) URL answers 403 AccessDenied.
  gateway  127.0.0.1:<port3>   the Hub's S3 gateway for buckets (https://s3.hf.co/NS), forwarding
                               to --gateway-target (else --s3): refuses unsigned requests (403),
                               answers GetObject from non-AWS user agents with a 302 to the cdn,
                               drops If-None-Match from CompleteMultipartUpload (the gateway
                               documents it for PutObject only), sends xet-style ETags (not MD5s),
                               404 NoSuchBucket for a bucket nobody created. Records the access key
                               id of every request.

Rate limits, as the Hub's: /resolve/ URLs count as "resolvers", /api/ as "api", each against its
quota (--resolver-quota, --api-quota; 0: unlimited) in fixed windows of --window hub seconds
(the Hub's: 300). Responses carry `RateLimit: "resolvers";r=<left>;t=<seconds to reset>` and
`RateLimit-Policy: "fixed window";"resolvers";q=<quota>;w=<window>`; past the quota, 429 with the
same headers. The hub clock runs --time-scale times faster than real time (default 1), so a test
can run the Hub's 300 s window in seconds while the headers carry the Hub's numbers.

Model repos: DIR/ORG/REPO/<files>, served read-only. Each repo has one fake commit,
sha1("fake-commit:ORG/REPO"), reachable as that 40-hex sha and as branch "main".
  GET  /api/models/ORG/REPO/revision/REV     {"id","sha","lastModified","siblings":[...]};
                                             404 RevisionNotFound for any other revision
  GET  /api/models/ORG/REPO/tree/REV[/PATH]?recursive=true|false&limit=N
                                             JSON array of {"type":"file","oid","size","path",
                                             ["lfs":{"oid","size","pointerSize"}]} and, when not
                                             recursive, {"type":"directory","oid","path"}; sorted
                                             by path; pages of min(limit, --page-size) entries
                                             with `Link: <absolute URL>; rel="next"` (cursor=)
  GET|HEAD /ORG/REPO/resolve/REV/PATH         LFS files (suffix .safetensors/.bin/.pt/.gguf or
                                             larger than --lfs-threshold): 302 to the cdn with
                                             X-Repo-Commit, X-Linked-Etag (sha256), X-Linked-Size,
                                             ETag; other files: 200/206 here with ETag (git blob
                                             sha1) and X-Repo-Commit. Range: bytes=a-b | a- | -n
                                             gives 206 + Content-Range, 416 when unsatisfiable.
                                             404 EntryNotFound (with X-Repo-Commit) for a missing
                                             file.

Buckets (with --s3, an S3-compatible server such as s3rver; only those named by --bucket or
created with control create_bucket= exist, else 404 RepoNotFound "Bucket not found"; namespace NS
is the S3 bucket
there, the bucket NAME the first key component — i.e. what the Hub's S3 gateway at
https://s3.hf.co/NS sees for bucket NAME, path-style). Objects are read from it unsigned:
  GET|HEAD /buckets/NS/NAME/resolve/PATH      always 302 to the cdn with X-Linked-Size (like the
                                             Hub's xet-backed buckets); 404 EntryNotFound
  GET  /api/buckets/NS/NAME/tree[/PATH]?recursive=true|false&limit=N
                                             [{"type":"file","path","size","xetHash","mtime",
                                             "uploadedAt"}, {"type":"directory","path"}], paths from
                                             the bucket root, PATH matched lexically (as the Hub
                                             does: "sub" also matches "submarine.txt"); recursive
                                             unless recursive=false (the Hub's default); paginated
                                             like the repo tree.

Auth: with --token T every repo and bucket is private: no Authorization -> 401 with
X-Error-Code RepoNotFound ("Repository not found", as the Hub answers for private repos);
a wrong token -> 401 X-Error-Message "Invalid credentials in Authorization header". A missing
repo -> 401 RepoNotFound without a token, 404 RepoNotFound with a valid one. --gated ORG/REPO:
resolve answers 403 X-Error-Code GatedRepo. The cdn never checks anything (its URLs are
"signed"), like a CDN.

Control (hub listener, never rate-limited nor counted):
  GET  /.fake-hub/stats     {"requests": hub requests, "cdn_requests", "rate_limited",
                             "resolver_requests" (429s included), "resolver_limited", "api_limited",
                             "cdn_expired" (signed URLs refused), "gateway": {requests, redirected,
                             multipart_creates, conditional_puts, stripped_if_none_match},
                             "gateway_keys": [access key ids the gateway saw],
                             "bytes": {"ORG/REPO/PATH" | "buckets/NS/NAME/KEY": body bytes sent by
                             either listener}, "cdn_authorization": [Authorization values the cdn
                             received], "hub_authorized": requests that carried a valid token,
                             "log": last 500 "listener METHOD path range" lines (never a token)}
  POST /.fake-hub/control?rate_limit_every=N&retry_after=S&ratelimit_header=0|1
                            answer every Nth hub request with 429 (N=0: never); Retry-After: S
                            unless S is empty; `RateLimit: "api";r=0;t=S` when ratelimit_header=1
                        ...&resolver_quota=N&api_quota=N&window=S&time_scale=K   (a fresh window)
                        ...&exhaust=1      a fresh window starts now with its resolver quota spent
                        ...&url_ttl=S&revoke_urls=1&token=T&create_bucket=NS/NAME
  POST /.fake-hub/reset     zero the counters

Where this fake simplifies the real Hub:
  - one commit per repo, only branch "main" (no tags, no refs/pr/N, no history, no expand=true
    fields such as lastCommit); repo ids must be ORG/REPO; no datasets/spaces;
  - no xet: LFS and bucket files redirect to a plain HTTP "cdn" serving the bytes with Range;
    no X-Xet-Hash / xet-auth links, no relative /api/resolve-cache redirects;
  - the tree cursor is a plain offset; limits are not capped at the Hub's 1000/10000;
  - one fixed token instead of read/write/fine-grained tokens; gating is all-or-nothing;
  - bucket writes are not implemented here: they go to the S3 server directly (what the Hub's S3
    gateway fronts); the bucket listing reads the S3 server's full listing and sorts it
    (s3rver lists in directory-walk order);
  - quotas count every request of a class from anyone (the Hub counts per user or IP).
"""

import argparse
import hashlib
import hmac
import http.client
import json
import math
import os
import signal
import socket
import sys
import threading
import time
import urllib.parse
import urllib.request
import urllib.error
import xml.etree.ElementTree as ET
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".onnx", ".h5", ".msgpack")
LAST_MODIFIED = "2024-05-01T12:00:00.000Z"


class State:
    def __init__(self, args):
        self.args = args
        self.lock = threading.Lock()  # guards everything mutable below
        self.hash_cache = {}          # (path, size, mtime) -> (sha1 git blob, sha256)
        self.hub_port = 0
        self.cdn_base = ""
        self.rate_limit_every = 0
        self.retry_after = "0"
        self.ratelimit_header = True
        # The Hub's fixed-window quotas (0: unlimited), in "hub seconds"; time_scale hub seconds
        # pass per real second (see the header).
        self.quota = {"resolvers": args.resolver_quota, "api": args.api_quota}
        self.window = float(args.window)
        self.time_scale = float(args.time_scale)
        self.start = time.monotonic()
        self.window_counts = {}  # (class, window index) -> requests
        self.url_ttl = float(args.url_ttl)
        self.secret = os.urandom(16)
        self.token = args.token
        self.buckets = set(args.bucket or [])
        self.reset()

    def reset(self):
        with self.lock:
            self.requests = 0
            self.cdn_requests = 0
            self.rate_limited = 0
            self.resolver_requests = 0
            self.resolver_limited = 0
            self.api_limited = 0
            self.cdn_expired = 0
            self.gateway = {"requests": 0, "redirected": 0, "multipart_creates": 0, "conditional_puts": 0,
                            "stripped_if_none_match": 0}
            self.gateway_keys = []
            self.hub_authorized = 0
            self.bytes = {}
            self.cdn_authorization = []
            self.log = []

    def add_bytes(self, name, n):
        with self.lock:
            self.bytes[name] = self.bytes.get(name, 0) + n

    def add_log(self, line):
        with self.lock:
            self.log.append(line)
            if len(self.log) > 500:
                del self.log[:100]

    # ---- repos ----
    def repo_dir(self, org, repo):
        if not self.args.repos:
            return None
        for part in (org, repo):
            if not part or part.startswith(".") or "/" in part or "\\" in part:
                return None
        d = os.path.join(self.args.repos, org, repo)
        return d if os.path.isdir(d) else None

    @staticmethod
    def commit_of(repo_id):
        return hashlib.sha1(("fake-commit:" + repo_id).encode()).hexdigest()

    def repo_files(self, d):
        out = []
        for root, dirs, files in os.walk(d):
            dirs[:] = [x for x in dirs if not x.startswith(".git")]
            for f in files:
                full = os.path.join(root, f)
                out.append(os.path.relpath(full, d).replace(os.sep, "/"))
        return sorted(out)

    def hashes(self, full):
        st = os.stat(full)
        key = (full, st.st_size, st.st_mtime_ns)
        with self.lock:
            if key in self.hash_cache:
                return self.hash_cache[key]
        sha1 = hashlib.sha1()
        sha1.update(b"blob %d\0" % st.st_size)
        sha256 = hashlib.sha256()
        with open(full, "rb") as fh:
            while True:
                b = fh.read(1 << 20)
                if not b:
                    break
                sha1.update(b)
                sha256.update(b)
        v = (sha1.hexdigest(), sha256.hexdigest())
        with self.lock:
            self.hash_cache[key] = v
        return v

    def is_lfs(self, path, size):
        return path.endswith(LFS_SUFFIXES) or size > self.args.lfs_threshold

    # ---- rate limits ----
    def hub_clock(self):
        """Hub seconds since start."""
        return (time.monotonic() - self.start) * self.time_scale

    def take_quota(self, cls):
        """(allowed, remaining, seconds to reset) for one request of class cls."""
        with self.lock:
            q = self.quota.get(cls, 0)
            now = self.hub_clock()
            index = int(now // self.window)
            reset = max(1, int(math.ceil(self.window - (now - index * self.window))))
            if q <= 0:
                return True, None, reset
            n = self.window_counts.get((cls, index), 0) + 1
            self.window_counts[(cls, index)] = n
            return n <= q, max(0, q - n), reset

    # ---- signed CDN URLs ----
    def sign(self, path):
        """path + a query signed like an S3 presigned URL (X-Amz-Date/X-Amz-Expires) that also
        carries CloudFront's absolute Expires=, as the Hub's cas-bridge URLs do."""
        now = time.time()
        expires = int(now + self.url_ttl)
        date = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
        sig = hmac.new(self.secret, ("%s|%d" % (path, expires)).encode(), hashlib.sha256).hexdigest()
        return "%s?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Date=%s&X-Amz-Expires=%d&Expires=%d&X-Amz-Signature=%s" % (
            path, date, int(self.url_ttl), expires, sig)

    def check_signature(self, path, q):
        """None when the signed URL is valid now, else the reason."""
        try:
            expires = int(q.get("Expires", ["0"])[0])
        except ValueError:
            return "bad Expires"
        want = hmac.new(self.secret, ("%s|%d" % (path, expires)).encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, q.get("X-Amz-Signature", [""])[0]):
            return "signature does not match"
        if time.time() > expires:
            return "Request has expired"
        return None

    # ---- buckets (S3 server) ----
    def s3_url(self, ns, key=""):
        return self.args.s3.rstrip("/") + "/" + urllib.parse.quote(ns) + ("/" + urllib.parse.quote(key) if key else "")

    def s3_get(self, ns, key, method="GET"):
        """(status, headers, body) of an unsigned request to the S3 server."""
        req = urllib.request.Request(self.s3_url(ns, key), method=method)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def s3_list(self, ns, prefix):
        """Every (key, size) under prefix, sorted by key."""
        out = []
        token = None
        for _ in range(10000):
            q = {"list-type": "2", "prefix": prefix, "max-keys": "1000"}
            if token:
                q["continuation-token"] = token
            url = self.s3_url(ns) + "?" + urllib.parse.urlencode(q)
            try:
                with urllib.request.urlopen(url, timeout=30) as r:
                    body = r.read()
            except urllib.error.HTTPError as e:
                if e.code == 404:
                    return None
                raise
            root = ET.fromstring(body)
            ns_ = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
            for c in root.findall(ns_ + "Contents"):
                out.append((c.find(ns_ + "Key").text, int(c.find(ns_ + "Size").text)))
            if (root.findtext(ns_ + "IsTruncated") or "false") != "true":
                break
            token = root.findtext(ns_ + "NextContinuationToken")
            if not token:
                break
        return sorted(set(out))


STATE = None


def parse_range(header, size):
    """(start, end_inclusive) or None for no range; 'bad' when unsatisfiable."""
    if not header or not header.startswith("bytes=") or "," in header:
        return None
    spec = header[6:].strip()
    a, _, b = spec.partition("-")
    try:
        if a == "":
            n = int(b)
            if n == 0:
                return "bad"
            return (max(0, size - n), size - 1)
        start = int(a)
        end = int(b) if b else size - 1
    except ValueError:
        return None
    if start >= size or end < start:
        return "bad"
    return (start, min(end, size - 1))


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "FakeHub/1.0"
    listener = "hub"

    def log_message(self, fmt, *args):
        if STATE.args.verbose:
            sys.stderr.write("fake_hub %s: %s\n" % (self.listener, fmt % args))

    # ---- plumbing ----
    def read_body(self):
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n > 0 else b""

    def send(self, status, body=b"", headers=None, head=False, count_as=None):
        self.send_response(status)
        hdrs = dict(getattr(self, "rate_headers", None) or {})
        hdrs.update(headers or {})
        if "Content-Type" not in hdrs and body:
            hdrs["Content-Type"] = "application/json" if body[:1] in (b"{", b"[") else "text/plain"
        for k, v in hdrs.items():
            self.send_header(k, str(v))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head and body:
            # Counted before the write: a client that asks for the stats right after receiving
            # the body must see it counted.
            if count_as:
                STATE.add_bytes(count_as, len(body))
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                return

    def send_json(self, obj, status=200, headers=None):
        self.send(status, json.dumps(obj).encode(), dict(headers or {}, **{"Content-Type": "application/json"}))

    def error(self, status, code, message, extra=None):
        h = {"X-Error-Code": code, "X-Error-Message": message}
        h.update(extra or {})
        self.send(status, json.dumps({"error": message}).encode(), h, head=self.command == "HEAD")

    def send_file_bytes(self, data_or_path, size, name, extra_headers, head):
        """Serves a whole file or the requested range of it. data_or_path: bytes or a path."""
        rng = parse_range(self.headers.get("Range"), size)
        if rng == "bad":
            self.send(416, b"", dict(extra_headers, **{"Content-Range": "bytes */%d" % size}), head=head)
            return
        start, end = (0, size - 1) if rng is None else rng
        if isinstance(data_or_path, (bytes, bytearray)):
            body = bytes(data_or_path[start:end + 1]) if size > 0 else b""
        else:
            with open(data_or_path, "rb") as fh:
                fh.seek(start)
                body = fh.read(end - start + 1) if size > 0 else b""
        h = dict(extra_headers)
        h["Accept-Ranges"] = "bytes"
        h["Content-Type"] = "application/octet-stream"
        if rng is None:
            self.send(200, body, h, head=head, count_as=name)
        else:
            h["Content-Range"] = "bytes %d-%d/%d" % (start, end, size)
            self.send(206, body, h, head=head, count_as=name)

    def path_parts(self):
        u = urllib.parse.urlsplit(self.path)
        return [urllib.parse.unquote(p) for p in u.path.split("/")[1:]], urllib.parse.parse_qs(u.query)

    def base_url(self):
        return "http://" + (self.headers.get("Host") or "127.0.0.1:%d" % STATE.hub_port)

    # ---- auth ----
    def auth(self):
        """'ok' (valid token or none needed), 'none' (no token), 'bad' (wrong token)."""
        got = self.headers.get("Authorization")
        with STATE.lock:
            want = STATE.token
        if got:
            if want and got == "Bearer " + want:
                with STATE.lock:
                    STATE.hub_authorized += 1
                return "ok"
            return "bad" if want else "ok"
        return "none" if want else "ok"

    def check_auth(self):
        """True when the request may go on; else the 401 was sent."""
        a = self.auth()
        if a == "ok":
            return True
        if a == "bad":
            self.error(401, "", "Invalid credentials in Authorization header")
        else:
            self.error(401, "RepoNotFound", "Repository not found")
        return False

    def missing_repo(self):
        if self.auth() == "ok" and self.headers.get("Authorization"):
            self.error(404, "RepoNotFound", "Repository not found")
        else:
            self.error(401, "RepoNotFound", "Repository not found")

    # ---- dispatch ----
    def do_GET(self):
        self.dispatch(head=False)

    def do_HEAD(self):
        self.dispatch(head=True)

    def do_POST(self):
        self.read_body()
        self.rate_headers = {}
        parts, q = self.path_parts()
        if parts[:2] == [".fake-hub", "control"]:
            with STATE.lock:
                if "rate_limit_every" in q:
                    STATE.rate_limit_every = int(q["rate_limit_every"][0])
                    STATE.requests_since_limit = 0
                if "retry_after" in q:
                    STATE.retry_after = q["retry_after"][0]
                elif "rate_limit_every" in q:
                    STATE.retry_after = ""
                if "ratelimit_header" in q:
                    STATE.ratelimit_header = q["ratelimit_header"][0] == "1"
                if "token" in q:
                    STATE.token = q["token"][0]
                for cls in ("resolvers", "api"):
                    if cls[:-1] + "_quota" in q or cls + "_quota" in q:
                        STATE.quota[cls] = int((q.get(cls[:-1] + "_quota") or q.get(cls + "_quota"))[0])
                if "window" in q:
                    STATE.window = float(q["window"][0])
                if "time_scale" in q:
                    STATE.time_scale = float(q["time_scale"][0])
                if "window" in q or "time_scale" in q or "resolver_quota" in q:
                    STATE.start = time.monotonic()  # a fresh first window
                    STATE.window_counts = {}
                if "exhaust" in q:
                    # A fresh window starts now with its resolver quota already spent (someone
                    # else on this IP used it): the next resolve gets 429 with t = the window.
                    STATE.start = time.monotonic()
                    STATE.window_counts = {("resolvers", 0): STATE.quota["resolvers"]}
                if "url_ttl" in q:
                    STATE.url_ttl = float(q["url_ttl"][0])
                if "revoke_urls" in q:
                    STATE.secret = os.urandom(16)  # every signed URL handed out so far answers 403
                if "create_bucket" in q:
                    STATE.buckets.add(q["create_bucket"][0])
            self.send_json({"ok": True})
            return
        if parts[:2] == [".fake-hub", "reset"]:
            STATE.reset()
            self.send_json({"ok": True})
            return
        self.error(405, "", "method not allowed")

    def dispatch(self, head):
        parts, q = self.path_parts()
        self.rate_headers = {}
        if parts[:2] == [".fake-hub", "stats"]:
            with STATE.lock:
                s = {"requests": STATE.requests, "cdn_requests": STATE.cdn_requests,
                     "rate_limited": STATE.rate_limited, "hub_authorized": STATE.hub_authorized,
                     "resolver_requests": STATE.resolver_requests, "resolver_limited": STATE.resolver_limited,
                     "api_limited": STATE.api_limited, "cdn_expired": STATE.cdn_expired,
                     "gateway": dict(STATE.gateway), "gateway_keys": list(STATE.gateway_keys),
                     "bytes": dict(STATE.bytes), "cdn_authorization": list(STATE.cdn_authorization),
                     "log": list(STATE.log)}
            self.send_json(s)
            return
        STATE.add_log("hub %s %s %s" % (self.command, urllib.parse.urlsplit(self.path).path,
                                        self.headers.get("Range") or "-"))
        with STATE.lock:
            STATE.requests += 1
            limited = False
            if STATE.rate_limit_every > 0 and STATE.requests % STATE.rate_limit_every == 0:
                STATE.rate_limited += 1
                limited = True
            retry_after, rl_header = STATE.retry_after, STATE.ratelimit_header
        if limited:
            h = {}
            if retry_after != "":
                h["Retry-After"] = retry_after
            if rl_header:
                h["RateLimit"] = '"api";r=0;t=%s' % (retry_after or "0")
                h["RateLimit-Policy"] = '"fixed window";"api";q=500;w=300'
            self.error(429, "", "You have been rate-limited", h)
            return
        # The Hub's quotas: /resolve/ URLs count as "resolvers", /api/ as "api", in fixed windows.
        cls = "resolvers" if "resolve" in parts else ("api" if parts[:1] == ["api"] else "")
        self.rate_headers = {}
        if cls:
            allowed, remaining, reset = STATE.take_quota(cls)
            with STATE.lock:
                if cls == "resolvers":
                    STATE.resolver_requests += 1
                policy = '"fixed window";"%s";q=%d;w=%d' % (cls, STATE.quota.get(cls, 0), int(STATE.window))
            if remaining is not None:
                self.rate_headers = {"RateLimit": '"%s";r=%d;t=%d' % (cls, remaining, reset),
                                     "RateLimit-Policy": policy}
            if not allowed:
                with STATE.lock:
                    STATE.rate_limited += 1
                    if cls == "resolvers":
                        STATE.resolver_limited += 1
                    else:
                        STATE.api_limited += 1
                self.error(429, "", "You have been rate-limited; you can retry this action in about %d seconds. "
                                    "If you're a new user, your limits will raise progressively over time." % reset,
                           self.rate_headers)
                return
        try:
            if len(parts) >= 5 and parts[0] == "api" and parts[1] == "models":
                self.api_models(parts[2], parts[3], parts[4:], q, head)
            elif len(parts) >= 5 and parts[0] == "api" and parts[1] == "buckets" and parts[4] == "tree":
                self.bucket_tree(parts[2], parts[3], "/".join(parts[5:]), q, head)
            elif len(parts) >= 5 and parts[0] == "buckets" and parts[3] == "resolve":
                self.bucket_resolve(parts[1], parts[2], "/".join(parts[4:]), head)
            elif len(parts) >= 5 and parts[2] == "resolve":
                self.repo_resolve(parts[0], parts[1], parts[3], "/".join(parts[4:]), head)
            else:
                self.error(404, "", "no such endpoint in the fake hub: " + self.path.split("?")[0])
        except (BrokenPipeError, ConnectionResetError):
            pass

    # ---- model repos ----
    def api_models(self, org, repo, rest, q, head):
        if not self.check_auth():
            return
        d = STATE.repo_dir(org, repo)
        if d is None:
            self.missing_repo()
            return
        repo_id = org + "/" + repo
        commit = STATE.commit_of(repo_id)
        if not rest or rest[0] not in ("revision", "tree") or len(rest) < 2:
            self.error(404, "", "unsupported repo API call")
            return
        rev = rest[1]
        if rev not in ("main", commit):
            self.error(404, "RevisionNotFound", "Invalid rev id: " + rev)
            return
        files = STATE.repo_files(d)
        if rest[0] == "revision":
            self.send_json({"id": repo_id, "modelId": repo_id, "sha": commit, "lastModified": LAST_MODIFIED,
                            "private": bool(STATE.args.token), "siblings": [{"rfilename": f} for f in files]})
            return
        # tree
        sub = "/".join(rest[2:])
        recursive = (q.get("recursive", ["false"])[0].lower() == "true")  # repo tree: non-recursive by default
        entries = []
        dirs = set()
        for f in files:
            if sub and not f.startswith(sub + "/"):
                continue
            rel = f[len(sub) + 1:] if sub else f
            if not recursive and "/" in rel:
                dirs.add((sub + "/" if sub else "") + rel.split("/")[0])
                continue
            full = os.path.join(d, f)
            size = os.path.getsize(full)
            sha1, sha256 = STATE.hashes(full)
            e = {"type": "file", "oid": sha1, "size": size, "path": f}
            if STATE.is_lfs(f, size):
                e["lfs"] = {"oid": sha256, "size": size, "pointerSize": 134}
            entries.append(e)
        for dpath in dirs:
            entries.append({"type": "directory", "oid": hashlib.sha1(dpath.encode()).hexdigest(), "path": dpath})
        if sub and not entries:
            self.error(404, "EntryNotFound", "%s does not exist on \"%s\"" % (sub, rev), {"X-Repo-Commit": commit})
            return
        entries.sort(key=lambda e: e["path"])
        self.send_page(entries, q)

    def send_page(self, entries, q):
        limit = STATE.args.page_size
        if "limit" in q:
            try:
                limit = max(1, min(limit, int(q["limit"][0])))
            except ValueError:
                pass
        try:
            cursor = int(q.get("cursor", ["0"])[0])
        except ValueError:
            cursor = 0
        page = entries[cursor:cursor + limit]
        headers = {}
        if cursor + limit < len(entries):
            u = urllib.parse.urlsplit(self.path)
            qs = [(k, v) for k, vs in q.items() for v in vs if k != "cursor"] + [("cursor", str(cursor + limit))]
            headers["Link"] = '<%s%s?%s>; rel="next"' % (self.base_url(), u.path, urllib.parse.urlencode(qs))
        self.send_json(page, headers=headers)

    def repo_resolve(self, org, repo, rev, path, head):
        if not self.check_auth():
            return
        d = STATE.repo_dir(org, repo)
        if d is None:
            self.missing_repo()
            return
        repo_id = org + "/" + repo
        commit = STATE.commit_of(repo_id)
        if rev not in ("main", commit):
            self.error(404, "RevisionNotFound", "Invalid rev id: " + rev)
            return
        if repo_id in (STATE.args.gated or []):
            self.error(403, "GatedRepo", "Access to model %s is restricted. You must have access to it and be "
                                         "authenticated to access it. Please log in." % repo_id)
            return
        full = os.path.normpath(os.path.join(d, path))
        if not path or ".." in path.split("/") or not full.startswith(d + os.sep) or not os.path.isfile(full):
            self.error(404, "EntryNotFound", "%s does not exist on \"%s\"" % (path, rev), {"X-Repo-Commit": commit})
            return
        size = os.path.getsize(full)
        sha1, sha256 = STATE.hashes(full)
        if STATE.is_lfs(path, size):
            location = STATE.cdn_base + STATE.sign("/cdn/repo/%s/%s/%s" % (urllib.parse.quote(repo_id), commit,
                                                                          urllib.parse.quote(path)))
            body = b"Found. Redirecting to " + location.encode()
            self.send(302, body, {"Location": location, "X-Repo-Commit": commit, "X-Linked-Etag": '"%s"' % sha256,
                                  "X-Linked-Size": size, "ETag": '"%s"' % sha1}, head=head)
            return
        self.send_file_bytes(full, size, repo_id + "/" + path,
                             {"X-Repo-Commit": commit, "ETag": '"%s"' % sha1}, head)

    # ---- buckets ----
    def bucket_resolve(self, ns, name, path, head):
        if not self.check_auth():
            return
        if not STATE.args.s3:
            self.error(404, "RepoNotFound", "this fake hub has no buckets (start it with --s3)")
            return
        if not self.bucket_exists(ns, name):
            return
        status, headers, _ = STATE.s3_get(ns, name + "/" + path, method="HEAD")
        if status == 404 or not path:
            self.error(404, "EntryNotFound", "%s does not exist in bucket %s/%s" % (path, ns, name))
            return
        if status != 200:
            self.error(502, "", "S3 server answered %d" % status)
            return
        size = int(headers.get("Content-Length", "0"))
        location = STATE.cdn_base + STATE.sign("/cdn/bucket/%s/%s/%s" % (
            urllib.parse.quote(ns), urllib.parse.quote(name), urllib.parse.quote(path)))
        body = b"Found. Redirecting to " + location.encode()
        self.send(302, body, {"Location": location, "X-Linked-Size": size,
                              "X-Linked-Etag": headers.get("ETag", '""')}, head=head)

    def bucket_exists(self, ns, name):
        """True, or the Hub's 404 for a bucket nobody created (`hf buckets create NS/NAME`)."""
        with STATE.lock:
            exists = (ns + "/" + name) in STATE.buckets
        if not exists:
            self.error(404, "RepoNotFound", "Bucket not found")
        return exists

    def bucket_tree(self, ns, name, sub, q, head):
        if not self.check_auth():
            return
        if not STATE.args.s3:
            self.error(404, "RepoNotFound", "this fake hub has no buckets (start it with --s3)")
            return
        if not self.bucket_exists(ns, name):
            return
        listing = STATE.s3_list(ns, name + "/" + sub)
        if listing is None:
            self.missing_repo()
            return
        recursive = q.get("recursive", ["true"])[0].lower() != "false"  # bucket tree: recursive by default
        entries, dirs = [], set()
        base = sub[: sub.rfind("/") + 1] if not recursive else ""
        for key, size in listing:
            p = key[len(name) + 1:]
            if not recursive:
                rel = p[len(base):]
                if "/" in rel:
                    dirs.add(base + rel.split("/")[0])
                    continue
            entries.append({"type": "file", "path": p, "size": size,
                            "xetHash": hashlib.sha256(("xet:" + p).encode()).hexdigest(),
                            "mtime": LAST_MODIFIED, "uploadedAt": LAST_MODIFIED})
        for dpath in dirs:
            entries.append({"type": "directory", "path": dpath, "uploadedAt": LAST_MODIFIED})
        entries.sort(key=lambda e: e["path"])
        self.send_page(entries, q)


class CdnHandler(Handler):
    listener = "cdn"

    def dispatch(self, head):
        parts, q = self.path_parts()
        auth = self.headers.get("Authorization")
        with STATE.lock:
            STATE.cdn_requests += 1
            if auth is not None:
                STATE.cdn_authorization.append(auth)
        STATE.add_log("cdn %s %s %s%s" % (self.command, urllib.parse.urlsplit(self.path).path,
                                          self.headers.get("Range") or "-", " AUTHORIZATION" if auth else ""))
        why = STATE.check_signature(urllib.parse.urlsplit(self.path).path, q)
        if why is not None:
            with STATE.lock:
                STATE.cdn_expired += 1
            body = ("<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>AccessDenied</Code>"
                    "<Message>%s</Message></Error>" % why).encode()
            self.send(403, body, {"Content-Type": "application/xml"}, head=head)
            return
        try:
            if len(parts) >= 6 and parts[:2] == ["cdn", "repo"]:
                org, repo, commit, path = parts[2], parts[3], parts[4], "/".join(parts[5:])
                d = STATE.repo_dir(org, repo)
                full = os.path.normpath(os.path.join(d, path)) if d else ""
                if (d is None or commit != STATE.commit_of(org + "/" + repo) or ".." in path.split("/")
                        or not full.startswith(d + os.sep) or not os.path.isfile(full)):
                    self.send(404, b"NoSuchKey", head=head)
                    return
                self.send_file_bytes(full, os.path.getsize(full), org + "/" + repo + "/" + path,
                                     {"ETag": '"%s"' % STATE.hashes(full)[1]}, head)
            elif len(parts) >= 5 and parts[:2] == ["cdn", "bucket"]:
                ns, name, path = parts[2], parts[3], "/".join(parts[4:])
                status, headers, body = STATE.s3_get(ns, name + "/" + path)
                if status != 200:
                    self.send(404 if status == 404 else 502, b"NoSuchKey", head=head)
                    return
                self.send_file_bytes(body, len(body), "buckets/%s/%s/%s" % (ns, name, path), {}, head)
            else:
                self.send(404, b"not found", head=head)
        except (BrokenPipeError, ConnectionResetError):
            pass


AWS_USER_AGENTS = ("aws-sdk-", "aws-cli/", "boto3/", "botocore/", "s3transfer/")
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "trailers", "transfer-encoding", "upgrade", "proxy-connection", "host", "content-length", "expect"}


class GatewayHandler(BaseHTTPRequestHandler):
    """The Hub's S3 gateway (https://s3.hf.co/NS, path-style: /NS/NAME/KEY), in front of the S3
    server holding the buckets (--gateway-target, else --s3). What it does that plain S3 does not:
      - GetObject from a user agent that is not an AWS SDK/CLI answers 302 to the cdn (a signed
        URL, like the Hub's xet bridge) instead of the bytes;
      - If-None-Match is honoured on PutObject only: it is dropped from CompleteMultipartUpload;
      - ETags are xet hashes, not MD5s;
      - a bucket nobody created answers 404 NoSuchBucket.
    It records the access key id of every signed request (gateway_keys in the stats)."""
    protocol_version = "HTTP/1.1"
    server_version = "FakeHubS3Gateway/1.0"

    def log_message(self, fmt, *args):
        if STATE.args.verbose:
            sys.stderr.write("fake_hub gateway: %s\n" % (fmt % args))

    def reply(self, status, body=b"", headers=None, length=None):
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def s3_error(self, status, code, message):
        body = ("<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>%s</Code><Message>%s</Message></Error>"
                % (code, message)).encode()
        self.reply(status, body, {"Content-Type": "application/xml"})

    def handle_any(self):
        u = urllib.parse.urlsplit(self.path)
        q = urllib.parse.parse_qs(u.query, keep_blank_values=True)
        raw = [p for p in u.path.split("/")[1:]]
        parts = [urllib.parse.unquote(p) for p in raw]
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n > 0 else b""
        auth = self.headers.get("Authorization") or ""
        with STATE.lock:
            STATE.gateway["requests"] += 1
            if "Credential=" in auth:
                STATE.gateway_keys.append(auth.split("Credential=", 1)[1].split("/", 1)[0])
            exists = len(parts) >= 2 and (parts[0] + "/" + parts[1]) in STATE.buckets
        if "Credential=" not in auth:
            self.s3_error(403, "AccessDenied", "Anonymous access is not allowed: sign with your HFAK... key")
            return
        if not exists:
            self.s3_error(404, "NoSuchBucket", "The specified bucket does not exist")
            return
        has_key = len(parts) >= 3 and parts[2] != ""
        agent = (self.headers.get("User-Agent") or "").lower()
        if (self.command == "GET" and has_key and "list-type" not in q and not agent.startswith(AWS_USER_AGENTS)):
            with STATE.lock:
                STATE.gateway["redirected"] += 1
            location = STATE.cdn_base + STATE.sign("/cdn/bucket/" + "/".join(raw))
            self.reply(302, b"", {"Location": location})
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        if self.command == "POST" and "uploadId" in q and "If-None-Match" in headers:
            del headers["If-None-Match"]
            with STATE.lock:
                STATE.gateway["stripped_if_none_match"] += 1
        if self.command == "POST" and "uploads" in q:
            with STATE.lock:
                STATE.gateway["multipart_creates"] += 1
        if self.command == "PUT" and "partNumber" not in q and "If-None-Match" in headers:
            with STATE.lock:
                STATE.gateway["conditional_puts"] += 1
        target = urllib.parse.urlsplit(STATE.args.gateway_target or STATE.args.s3)
        conn = http.client.HTTPConnection(target.hostname, target.port or 80, timeout=60)
        try:
            headers["Content-Length"] = str(len(body))
            conn.request(self.command, self.path, body=body, headers=headers)
            r = conn.getresponse()
            data = r.read()
            out = {}
            for k, v in r.getheaders():
                if k.lower() in HOP_BY_HOP:
                    continue
                if k.lower() == "etag":
                    v = '"xet-%s"' % hashlib.sha256(v.encode()).hexdigest()[:32]
                out[k] = v
            # A HEAD answer has no body but the object's length.
            length = r.getheader("Content-Length") if self.command == "HEAD" else None
            self.reply(r.status, data, out, length)
        except OSError as e:
            self.s3_error(502, "InternalError", "gateway could not reach the S3 server: %s" % e)
        finally:
            conn.close()

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = handle_any


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


def main():
    global STATE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repos", default="", help="directory of ORG/REPO model repos")
    ap.add_argument("--s3", default="", help="S3-compatible server holding the buckets (path-style, unsigned)")
    ap.add_argument("--token", default="", help="require this token (Authorization: Bearer) everywhere")
    ap.add_argument("--gated", action="append", help="ORG/REPO whose files answer 403 GatedRepo")
    ap.add_argument("--page-size", type=int, default=1000, help="tree entries per page")
    ap.add_argument("--lfs-threshold", type=int, default=10 * 1024, help="larger files are LFS (redirected)")
    ap.add_argument("--bucket", action="append", help="NS/NAME: a bucket that exists (more with create_bucket=)")
    ap.add_argument("--gateway-target", default="", help="S3 server behind the S3 gateway listener (default --s3)")
    ap.add_argument("--resolver-quota", type=int, default=0, help="resolver requests per window (0: unlimited)")
    ap.add_argument("--api-quota", type=int, default=0, help="API requests per window (0: unlimited)")
    ap.add_argument("--window", type=float, default=300, help="quota window in hub seconds (the Hub's: 300)")
    ap.add_argument("--time-scale", type=float, default=1, help="hub seconds per real second")
    ap.add_argument("--url-ttl", type=float, default=3600, help="lifetime of signed cdn URLs, seconds")
    ap.add_argument("--listen-port", type=int, default=0)
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    STATE = State(args)

    hub = Server(("127.0.0.1", args.listen_port), Handler)
    STATE.hub_port = hub.server_address[1]
    try:
        cdn = Server(("127.0.0.2", 0), CdnHandler)
        STATE.cdn_base = "http://127.0.0.2:%d" % cdn.server_address[1]
    except OSError:
        cdn = Server(("127.0.0.1", 0), CdnHandler)
        STATE.cdn_base = "http://localhost:%d" % cdn.server_address[1]

    gateway = Server(("127.0.0.1", 0), GatewayHandler)
    gateway_url = "http://127.0.0.1:%d" % gateway.server_address[1]

    def stop(*_):
        threading.Thread(target=hub.shutdown, daemon=True).start()
        threading.Thread(target=cdn.shutdown, daemon=True).start()
        threading.Thread(target=gateway.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    t = threading.Thread(target=cdn.serve_forever, daemon=True)
    t.start()
    threading.Thread(target=gateway.serve_forever, daemon=True).start()
    sys.stdout.write("PORT %d %s %s\n" % (STATE.hub_port, STATE.cdn_base, gateway_url))
    sys.stdout.flush()
    hub.serve_forever()
    cdn.shutdown()
    gateway.shutdown()


if __name__ == "__main__":
    main()
