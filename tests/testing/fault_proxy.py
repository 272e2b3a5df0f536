#!/usr/bin/env python3
"""A fault-injecting HTTP reverse proxy for tests (Python 3 standard library only).

Forwards every request (any method: GET, HEAD, PUT, DELETE, PROPFIND, MOVE, MKCOL, POST, ...)
with its headers and body to --target and streams the answer back, while injecting faults at
random, each decided per request before anything is forwarded:

  error   answer --error-status (503) with Retry-After if --retry-after is set; not forwarded
  stall   sleep --stall-seconds, then forward (--stall-where before) or send the headers and the
          first half of the body, sleep, then the rest (--stall-where body)
  reset   close the client connection with a TCP RST; not forwarded

    fault_proxy.py --listen-port 0 --target http://127.0.0.1:8080 --error-rate 0.2 \\
        --stall-rate 0.05 --stall-seconds 5 --reset-rate 0.0 --seed 1 --mode-file /tmp/mode

Prints "PORT <n>" as the first line of stdout once it accepts connections; nothing else goes
to stdout (logs, with --verbose, go to stderr). Stops on SIGTERM/SIGINT.

Modes: --down answers 503 to everything. --mode-file names a file read before each request (a
missing or empty file means "normal") holding one word: normal (faults at the given rates) |
down (503 to everything) | stall (stall every request, as --stall-where says) | stall-before |
stall-body (stall every request there) | reset (reset every connection) | flip-put (flip one bit
of every PUT body; --flip-put-rate does it to a fraction of them in normal mode). A test switches modes
by rewriting the file (atomically: write a temporary, rename it over).

Headers: Host is passed through unchanged by default, so request signatures that cover it
(S3 SigV4) stay valid and a WebDAV Destination naming the proxy stays consistent with it.
With --host-header target, Host is set to the target's and an absolute Destination that names
the proxy is rewritten to name the target. Hop-by-hop headers are not forwarded.

GET /.fault-proxy/stats answers (without forwarding) a JSON object of counters:
requests, forwarded, errors, stalls, resets, sent_bytes_<METHOD> (response body bytes relayed to
clients, per method: what the server behind served), and received_<METHOD> per method (counted when the
request has arrived, before it is stalled or forwarded: a test can tell that a request is in
the proxy's hands), and for requests with a Destination (WebDAV MOVE) received_<METHOD>_to_<the
destination's folder>.
"""

import argparse
import http.client
import json
import os
import random
import signal
import socket
import struct
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "proxy-connection",
}
STATS_PATH = "/.fault-proxy/stats"


class Config:
    def __init__(self, args):
        self.args = args
        t = urllib.parse.urlsplit(args.target)
        if t.scheme not in ("http", "https") or not t.hostname:
            raise SystemExit(f"fault_proxy: --target must be http(s)://host:port, got {args.target!r}")
        self.scheme = t.scheme
        self.host = t.hostname
        self.port = t.port or (443 if t.scheme == "https" else 80)
        self.base_path = t.path.rstrip("/")
        self.netloc = t.netloc
        self.rng = random.Random(args.seed)
        self.rng_lock = threading.Lock()
        self.stats = {"requests": 0, "forwarded": 0, "errors": 0, "stalls": 0, "resets": 0}
        self.stats_lock = threading.Lock()

    def count(self, name, n=1):
        with self.stats_lock:
            self.stats[name] = self.stats.get(name, 0) + n

    def mode(self):
        if self.args.down:
            return "down"
        if not self.args.mode_file:
            return "normal"
        try:
            with open(self.args.mode_file, encoding="utf-8") as f:
                word = f.read().strip()
        except OSError:
            return "normal"
        return word or "normal"

    def flip_put(self):
        if self.args.flip_put_rate <= 0:
            return False
        with self.rng_lock:
            return self.rng.random() < self.args.flip_put_rate

    def fault(self):
        """The fault for the next request: None, 'error', 'stall', ('stall', where) or 'reset'."""
        mode = self.mode()
        if mode == "down":
            return "error"
        if mode in ("stall", "reset"):
            return mode
        if mode == "stall-before":
            return ("stall", "before")
        if mode == "stall-body":
            return ("stall", "body")
        with self.rng_lock:
            x = self.rng.random()
        a = self.args
        if x < a.error_rate:
            return "error"
        if x < a.error_rate + a.stall_rate:
            return "stall"
        if x < a.error_rate + a.stall_rate + a.reset_rate:
            return "reset"
        return None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like a real server
    server_version = "fault-proxy"
    config = None  # set in main

    def setup(self):
        super().setup()
        # Headers and body go out in separate writes; without this, Nagle + delayed ACK add
        # ~40 ms to every answer.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, fmt, *args):
        if self.config.args.verbose:
            sys.stderr.write("fault_proxy: " + (fmt % args) + "\n")

    # Every method goes through one handler.
    def __getattr__(self, name):
        if name.startswith("do_"):
            return self.handle_any
        raise AttributeError(name)

    def read_body(self):
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts = []
            while True:
                line = self.rfile.readline(65537)
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                parts.append(self.rfile.read(size))
                self.rfile.readline(65537)
            return b"".join(parts)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def send_simple(self, status, body, extra=()):
        self.send_response(status)
        for k, v in extra:
            self.send_header(k, v)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def reset_connection(self):
        # SO_LINGER with a zero timeout makes close() send RST instead of FIN.
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass
        self.close_connection = True

    def handle_any(self):
        cfg = self.config
        body = self.read_body()
        if self.command == "GET" and self.path == STATS_PATH:
            with cfg.stats_lock:
                payload = json.dumps(cfg.stats).encode()
            self.send_simple(200, payload)
            return
        cfg.count("requests")
        cfg.count("received_" + self.command)  # as it arrives, before any stall
        dest = self.headers.get("Destination")
        if dest:  # a WebDAV MOVE/COPY: also by the folder it goes to ("received_MOVE_to_versions")
            parts = urllib.parse.urlsplit(dest).path.rstrip("/").split("/")
            if len(parts) >= 2:
                cfg.count("received_" + self.command + "_to_" + parts[-2])
        fault = cfg.fault()
        if fault == "error":
            cfg.count("errors")
            extra = [("Retry-After", str(cfg.args.retry_after))] if cfg.args.retry_after is not None else []
            self.send_simple(cfg.args.error_status, b"fault_proxy: injected error\n", extra)
            return
        if fault == "reset":
            cfg.count("resets")
            self.reset_connection()
            return
        if self.command == "PUT" and body and (cfg.mode() == "flip-put" or cfg.flip_put()):
            # One bit on the way up, as a bad NIC or a broken middlebox would: the request
            # goes through otherwise unchanged (headers, length, signature).
            with cfg.rng_lock:
                at = cfg.rng.randrange(len(body))
                bit = 1 << cfg.rng.randrange(8)
            body = body[:at] + bytes([body[at] ^ bit]) + body[at + 1:]
            cfg.count("flipped_puts")
        stall_body = False
        where = cfg.args.stall_where
        if isinstance(fault, tuple):
            fault, where = fault
        if fault == "stall":
            cfg.count("stalls")
            if where == "before":
                time.sleep(cfg.args.stall_seconds)
            else:
                stall_body = True
        self.forward(body, stall_body)

    def forward(self, body, stall_body):
        cfg = self.config
        headers = {}
        for k, v in self.headers.items():
            if k.lower() in HOP_BY_HOP or k.lower() == "content-length":
                continue
            headers[k] = v
        if cfg.args.host_header == "target":
            headers = {k: v for k, v in headers.items() if k.lower() != "host"}
            headers["Host"] = cfg.netloc
            dest = self.headers.get("Destination")
            if dest:
                d = urllib.parse.urlsplit(dest)
                if d.scheme in ("http", "https") and d.netloc == self.headers.get("Host", ""):
                    headers = {k: v for k, v in headers.items() if k.lower() != "destination"}
                    headers["Destination"] = urllib.parse.urlunsplit(
                        (cfg.scheme, cfg.netloc, cfg.base_path + d.path, d.query, d.fragment))
        if body or self.command in ("PUT", "POST", "PATCH"):
            headers["Content-Length"] = str(len(body))
        conn_cls = http.client.HTTPSConnection if cfg.scheme == "https" else http.client.HTTPConnection
        conn = conn_cls(cfg.host, cfg.port, timeout=cfg.args.upstream_timeout)
        try:
            conn.connect()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.putrequest(self.command, cfg.base_path + self.path, skip_host=True, skip_accept_encoding=True)
            if "Host" not in headers and "host" not in {k.lower() for k in headers}:
                headers["Host"] = cfg.netloc
            for k, v in headers.items():
                conn.putheader(k, v)
            conn.endheaders(body if body else None)
            resp = conn.getresponse()
        except OSError as e:
            conn.close()
            self.send_simple(502, f"fault_proxy: upstream unreachable: {e}\n".encode())
            return
        cfg.count("forwarded")
        try:
            self.relay(resp, stall_body)
        finally:
            conn.close()

    def relay(self, resp, stall_body):
        cfg = self.config
        self.send_response_only(resp.status, resp.reason)
        length = resp.getheader("Content-Length")
        no_body = self.command == "HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200
        for k, v in resp.getheaders():
            if k.lower() not in HOP_BY_HOP:
                self.send_header(k, v)
        chunked = not no_body and length is None
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if no_body:
            self.wfile.flush()
            return

        def write(data):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
            cfg.count("sent_bytes_" + self.command, len(data))

        if stall_body:
            # Half of the body (or its first piece when the length is unknown), then silence.
            head = resp.read(max(1, int(length) // 2) if length is not None else 64 * 1024)
            if head:
                write(head)
            self.wfile.flush()
            time.sleep(cfg.args.stall_seconds)
        while True:
            data = resp.read(64 * 1024)
            if not data:
                break
            write(data)
        if chunked:
            self.wfile.write(b"0\r\n\r\n")
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
        if Handler.config.args.verbose:
            super().handle_error(request, client_address)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--listen-host", default="127.0.0.1")
    p.add_argument("--listen-port", type=int, default=0)
    p.add_argument("--target", required=True, help="http(s)://host:port[/base-path]")
    p.add_argument("--error-rate", type=float, default=0.0)
    p.add_argument("--error-status", type=int, default=503)
    p.add_argument("--retry-after", type=int, default=None, help="Retry-After seconds on injected errors")
    p.add_argument("--stall-rate", type=float, default=0.0)
    p.add_argument("--stall-seconds", type=float, default=5.0)
    p.add_argument("--stall-where", choices=("before", "body"), default="before")
    p.add_argument("--reset-rate", type=float, default=0.0)
    p.add_argument("--flip-put-rate", type=float, default=0.0,
                   help="flip one bit of this fraction of non-empty PUT bodies on their way up")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--down", action="store_true", help="answer 503 to everything")
    p.add_argument("--mode-file", default=None, help="file holding normal|down|stall|reset")
    p.add_argument("--host-header", choices=("preserve", "target"), default="preserve")
    p.add_argument("--upstream-timeout", type=float, default=60.0)
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()

    Handler.config = Config(args)
    server = Server((args.listen_host, args.listen_port), Handler)

    def stop(signum, frame):
        # Leave at once: stalled handler threads are daemons.
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    sys.stdout.write(f"PORT {server.server_address[1]}\n")
    sys.stdout.flush()
    server.serve_forever(poll_interval=0.2)


if __name__ == "__main__":
    main()
