#!/usr/bin/env python3
"""What s3rver lacks, in front of it: conditional writes and S3 errors on demand (tests only).

s3rver 3.7.1 ignores `If-None-Match: *` and never verifies SigV4 signatures (it only checks that
the access key id is its own). This reverse proxy (Python 3 standard library only) adds:

  Conditional create. A PUT of an object, or a CompleteMultipartUpload (POST ?uploadId=...),
  that carries `If-None-Match: *` is decided here, under one lock: HEAD the key upstream; if it
  exists answer 412 with S3's PreconditionFailed XML, else forward the request. Every client that
  goes through this proxy therefore sees S3's atomic create-if-absent.

  Atomic writes. s3rver writes an object in place as its body arrives, so a GET during a PUT
  can see a truncated object (a manifest of 1 byte), which S3 never shows. Requests on one key
  are therefore ordered here: a write (PUT of an object, CompleteMultipartUpload, DELETE) waits
  for the key's reads in flight and runs alone; a read (GET, HEAD) waits for the key's write.

  S3 list order. s3rver returns ListObjectsV2 keys in the order it walks its directories
  ("a/c" before "a-z"), not in S3's byte order, and its start-after skips keys because of that.
  A ListObjectsV2 (GET on the bucket with list-type=2) is therefore answered here from
  s3rver's complete listing of the prefix (at most 1000 keys, else 500), sorted by key bytes,
  with S3's start-after, continuation-token and max-keys semantics.

  Control, answered by the proxy itself (any method), e.g. POST /.s3-proxy/control?fail=403:AccessDenied
      fail=<status>:<Code>   answer requests with that S3 error document instead of forwarding;
                             "fail=" clears it
      count=<n>              ... only the next n matching requests (default: until cleared)
      match=<text>           ... only requests whose "METHOD path?query" contains <text>
      region=<r>             ... with <Region>r</Region> in the error (wrong-region errors)
      drop=<n>               forward the next n conditional writes, then reset the client's
                             connection without answering (a response lost on the way back)
  GET /.s3-proxy/stats answers JSON counters: requests, forwarded, injected, conditional,
  precondition_failed, dropped, part_uploads, completes, aborts; with --tokens-file also
  signed_ok, token_missing, token_unknown, token_expired, bad_signature and tokens_used (the
  session tokens requests were accepted with, in order of first use).

  Temporary credentials (--tokens-file F, written by fake_aws_credentials.py): every request
  must carry an x-amz-security-token listed in F (else 403 InvalidToken), not yet expired (else
  400 ExpiredToken, as S3 answers), and a SigV4 signature made with that token's secret (else
  403 SignatureDoesNotMatch). s3rver checks none of this.

    s3_precondition_proxy.py --target http://127.0.0.1:4568 [--listen-port 0] [--tokens-file F]

Prints "PORT <n>" as the first line of stdout once it accepts connections. Stops on SIGTERM.
"""

import argparse
import http.client
import json
import os
import signal
import socket
import struct
import sys
import threading
import time
import urllib.parse
import xml.etree.ElementTree as ET
from xml.sax.saxutils import escape
from contextlib import contextmanager, nullcontext
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_aws_credentials import sigv4_ok  # noqa: E402

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
              "trailer", "trailers", "transfer-encoding", "upgrade", "proxy-connection",
              "content-length", "expect"}


class KeyLocks:
    """Readers-writer locks by object key; a waiting writer holds off new readers."""

    def __init__(self):
        self.cv = threading.Condition()
        self.readers = {}       # key -> reads in flight
        self.writing = set()    # keys with a write in flight
        self.waiting = {}       # key -> writers waiting

    @contextmanager
    def read(self, key):
        with self.cv:
            while key in self.writing or self.waiting.get(key):
                self.cv.wait()
            self.readers[key] = self.readers.get(key, 0) + 1
        try:
            yield
        finally:
            with self.cv:
                self.readers[key] -= 1
                if not self.readers[key]:
                    del self.readers[key]
                self.cv.notify_all()

    @contextmanager
    def write(self, key):
        with self.cv:
            self.waiting[key] = self.waiting.get(key, 0) + 1
            while key in self.writing or self.readers.get(key):
                self.cv.wait()
            self.waiting[key] -= 1
            if not self.waiting[key]:
                del self.waiting[key]
            self.writing.add(key)
        try:
            yield
        finally:
            with self.cv:
                self.writing.discard(key)
                self.cv.notify_all()


class State:
    def __init__(self, target, tokens_file=None):
        self.tokens_file = tokens_file
        self.tokens_used = []
        t = urllib.parse.urlsplit(target)
        if t.scheme != "http" or not t.hostname:
            raise SystemExit(f"s3_precondition_proxy: --target must be http://host:port, got {target!r}")
        self.host, self.port = t.hostname, t.port or 80
        self.lock = threading.Lock()            # guards everything below
        self.create_lock = threading.Lock()     # serialises conditional writes (HEAD + forward)
        self.keys = KeyLocks()                  # orders reads and writes of one object
        self.fail = None                        # (status, code, region) or None
        self.fail_count = None                  # None: unlimited
        self.fail_match = ""
        self.drop = 0
        self.stats = {k: 0 for k in ("requests", "forwarded", "injected", "conditional",
                                     "precondition_failed", "dropped", "part_uploads",
                                     "completes", "aborts", "signed_ok", "token_missing",
                                     "token_unknown", "token_expired", "bad_signature")}

    def count(self, name):
        with self.lock:
            self.stats[name] += 1

    def take_fault(self, request_line):
        with self.lock:
            if self.fail is None or self.fail_match not in request_line:
                return None
            if self.fail_count is not None:
                if self.fail_count <= 0:
                    return None
                self.fail_count -= 1
            return self.fail

    def take_drop(self):
        with self.lock:
            if self.drop > 0:
                self.drop -= 1
                return True
            return False


def error_xml(code, message, region=""):
    extra = f"<Region>{region}</Region>" if region else ""
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>{message}</Message>{extra}<RequestId>proxy</RequestId></Error>").encode()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state = None  # set in main

    def log_message(self, fmt, *args):
        pass

    def __getattr__(self, name):
        if name.startswith("do_"):
            return self.handle_any
        raise AttributeError(name)

    def reply(self, status, body, content_type="application/xml"):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def reset_connection(self):
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass
        self.close_connection = True

    def control(self, query):
        st = self.state
        q = urllib.parse.parse_qs(query, keep_blank_values=True)
        with st.lock:
            if "fail" in q:
                spec = q["fail"][0]
                if spec:
                    status, code = spec.split(":", 1)
                    st.fail = (int(status), code, q.get("region", [""])[0])
                    st.fail_count = int(q["count"][0]) if "count" in q else None
                    st.fail_match = q.get("match", [""])[0]
                else:
                    st.fail, st.fail_count, st.fail_match = None, None, ""
            if "drop" in q:
                st.drop = int(q["drop"][0])
        self.reply(200, b"ok\n", "text/plain")

    def credentials_ok(self, body):
        st = self.state
        token = self.headers.get("x-amz-security-token")
        if not token:
            st.count("token_missing")
            self.reply(403, error_xml("InvalidToken", "no session token (temporary credentials expected)"))
            return False
        with open(st.tokens_file) as f:
            issued = json.load(f)
        if token not in issued:
            st.count("token_unknown")
            self.reply(403, error_xml("InvalidToken", "The provided token is malformed or otherwise invalid."))
            return False
        if issued[token]["expires"] <= time.time():
            st.count("token_expired")
            self.reply(400, error_xml("ExpiredToken", "The provided token has expired."))
            return False
        headers = {k.lower(): v for k, v in self.headers.items()}
        if not sigv4_ok(self.command, self.path, headers, body, headers.get("authorization", "x").split("Credential=")[-1].split("/")[0],
                        issued[token]["secret"], "s3"):
            st.count("bad_signature")
            self.reply(403, error_xml("SignatureDoesNotMatch", "The request signature we calculated does not match"))
            return False
        st.count("signed_ok")
        with st.lock:
            if token not in st.tokens_used:
                st.tokens_used.append(token)
        return True

    def handle_any(self):
        st = self.state
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length > 0 else b""
        path, _, query = self.path.partition("?")
        if path == "/.s3-proxy/control":
            self.control(query)
            return
        if path == "/.s3-proxy/stats":
            with st.lock:
                payload = json.dumps(dict(st.stats, tokens_used=st.tokens_used)).encode()
            self.reply(200, payload, "application/json")
            return
        st.count("requests")
        if st.tokens_file and not self.credentials_ok(body):
            return
        params = urllib.parse.parse_qs(query, keep_blank_values=True)
        if self.command == "PUT" and "partNumber" in params:
            st.count("part_uploads")
        if self.command == "POST" and "uploadId" in params:
            st.count("completes")
        if self.command == "DELETE" and "uploadId" in params:
            st.count("aborts")

        fault = st.take_fault(f"{self.command} {self.path}")
        if fault is not None:
            st.count("injected")
            status, code, region = fault
            self.reply(status, error_xml(code, f"injected by s3_precondition_proxy ({code})", region))
            return

        if self.command == "GET" and params.get("list-type") == ["2"] and path.count("/") <= 1:
            self.list_objects_v2(path, params)
            return

        conditional = (self.headers.get("If-None-Match", "").strip() == "*" and
                       ((self.command == "PUT" and "partNumber" not in params) or
                        (self.command == "POST" and "uploadId" in params)))
        is_object = path.count("/") >= 2
        writes = is_object and ((self.command == "PUT" and "partNumber" not in params) or
                                (self.command == "POST" and "uploadId" in params) or
                                (self.command == "DELETE" and "uploadId" not in params))
        reads = is_object and self.command in ("GET", "HEAD") and "uploadId" not in params
        if not conditional:
            if writes:
                self.forward(body, st.keys.write(path))
            elif reads:
                self.forward(body, st.keys.read(path))
            else:
                self.forward(body)
            return
        st.count("conditional")
        with st.create_lock, st.keys.write(path):
            if self.upstream_exists(path):
                st.count("precondition_failed")
                self.reply(412, error_xml("PreconditionFailed",
                                          "At least one of the pre-conditions you specified did not hold"))
                return
            status, headers, data = self.upstream(self.command, self.path, body, drop_condition=True)
        if st.take_drop():
            st.count("dropped")
            self.reset_connection()
            return
        self.relay(status, headers, data)

    def list_objects_v2(self, path, params):
        prefix = params.get("prefix", [""])[0]
        query = urllib.parse.urlencode({"list-type": "2", "max-keys": "1000", "prefix": prefix},
                                       quote_via=urllib.parse.quote)
        status, headers, data = self.upstream("GET", f"{path}?{query}", b"")
        if status != 200:
            self.relay(status, headers, data)
            return
        root = ET.fromstring(data)
        ns = root.tag[:root.tag.index("}") + 1] if root.tag.startswith("{") else ""
        if (root.findtext(f"{ns}IsTruncated") or "false") == "true":
            self.reply(500, error_xml("InternalError", "s3_precondition_proxy: more than 1000 keys under the prefix"))
            return
        items = []
        for c in root.findall(f"{ns}Contents"):
            items.append((c.findtext(f"{ns}Key"), c.findtext(f"{ns}Size"), c.findtext(f"{ns}ETag") or "",
                          c.findtext(f"{ns}LastModified") or ""))
        items.sort(key=lambda it: it[0].encode())
        start = params.get("start-after", [""])[0]
        token = params.get("continuation-token", [""])[0]
        if token:
            start = urllib.parse.unquote(token[len("proxy:"):])
        if start:
            items = [it for it in items if it[0].encode() > start.encode()]
        max_keys = min(int(params.get("max-keys", ["1000"])[0]), 1000)
        page, truncated = items[:max_keys], len(items) > max_keys
        out = ['<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">',
               f"<Prefix>{escape(prefix)}</Prefix><KeyCount>{len(page)}</KeyCount><MaxKeys>{max_keys}</MaxKeys>",
               f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>"]
        for key, size, etag, modified in page:
            out.append(f"<Contents><Key>{escape(key)}</Key><LastModified>{modified}</LastModified>"
                       f"<ETag>{escape(etag)}</ETag><Size>{size}</Size></Contents>")
        if truncated:
            out.append(f"<NextContinuationToken>proxy:{urllib.parse.quote(page[-1][0])}</NextContinuationToken>")
        out.append("</ListBucketResult>")
        self.reply(200, "".join(out).encode())

    def upstream_exists(self, path):
        status, _, _ = self.upstream("HEAD", path, b"", drop_condition=True)
        return status == 200

    def upstream(self, method, path, body, drop_condition=False):
        st = self.state
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        if drop_condition:
            headers = {k: v for k, v in headers.items() if k.lower() != "if-none-match"}
        if method == "HEAD":
            headers = {k: v for k, v in headers.items()
                       if k.lower() in ("host", "authorization", "x-amz-date", "x-amz-content-sha256",
                                        "x-amz-security-token")}
        conn = http.client.HTTPConnection(st.host, st.port, timeout=60)
        try:
            conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for k, v in headers.items():
                conn.putheader(k, v)
            if body or method in ("PUT", "POST"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body if body else None)
            resp = conn.getresponse()
            data = resp.read()
            st.count("forwarded")
            return resp.status, resp.getheaders(), data
        finally:
            conn.close()

    def forward(self, body, held=None):
        """Relays the request upstream, under `held` (a lock's context) while upstream answers."""
        try:
            with held if held is not None else nullcontext():
                status, headers, data = self.upstream(self.command, self.path, body)
        except OSError as e:
            self.reply(502, f"upstream unreachable: {e}\n".encode(), "text/plain")
            return
        self.relay(status, headers, data)

    def relay(self, status, headers, data):
        self.send_response_only(status)
        for k, v in headers:
            if k.lower() not in HOP_BY_HOP:
                self.send_header(k, v)
        no_body = self.command == "HEAD" or status in (204, 304)
        if not no_body:
            self.send_header("Content-Length", str(len(data)))
        elif self.command == "HEAD":
            for k, v in headers:
                if k.lower() == "content-length":
                    self.send_header(k, v)
        self.end_headers()
        if not no_body:
            self.wfile.write(data)
        self.wfile.flush()

    def handle_one_request(self):
        try:
            super().handle_one_request()
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            self.close_connection = True


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def handle_error(self, request, client_address):
        pass


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--listen-port", type=int, default=0)
    p.add_argument("--target", required=True)
    p.add_argument("--tokens-file")
    args = p.parse_args()
    Handler.state = State(args.target, args.tokens_file)
    server = Server(("127.0.0.1", args.listen_port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    signal.signal(signal.SIGINT, lambda *_: os._exit(0))
    sys.stdout.write(f"PORT {server.server_address[1]}\n")
    sys.stdout.flush()
    server.serve_forever(poll_interval=0.2)


if __name__ == "__main__":
    main()
