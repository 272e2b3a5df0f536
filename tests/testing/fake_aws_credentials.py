#!/usr/bin/env python3
"""The AWS credential endpoints a cluster node talks to, on loopback (tests only).

One HTTP server (Python 3 standard library only) answers as:

  EC2 instance metadata, IMDSv2 only:
      PUT /latest/api/token                      (X-aws-ec2-metadata-token-ttl-seconds) -> a token
      GET /latest/meta-data/iam/security-credentials/        -> the role name   (token required: 401)
      GET /latest/meta-data/iam/security-credentials/<role>  -> the credentials JSON
  a container endpoint (ECS, EKS pod identity):
      GET /ecs/<anything>         Authorization must be --container-token if that is given (401)
  STS (POST /, form body):
      Action=AssumeRoleWithWebIdentity   WebIdentityToken must be --web-identity-token
      Action=AssumeRole                  SigV4-signed (service sts) by --source-key-id, with
                                         --source-secret; the signature is checked
  a credential_process helper:
      GET /process                -> the "Version": 1 JSON a credential_process prints

Every answer issues new credentials: access key id --access-key-id (s3rver knows only its own),
a new secret and session token, valid for --lifetime seconds (see /control). Each issue is added
to the JSON file --tokens-file ({token: {"secret": s, "expires": unix seconds, "by": provider}}),
written atomically, which s3_precondition_proxy.py --tokens-file reads to accept exactly these
credentials (and check every request's signature against them).

Control and counters (any method):
  /control?lifetime=S           credentials issued from now on last S seconds
  /control?expire_all=1         every credential issued so far expires now (in the tokens file)
  /control?fail=<provider>:<status>   answer that provider's credential requests with <status>
                                ("fail=" clears); providers: imds, container, sts_web, sts_assume, process
  /stats                        JSON: requests and issues by provider, imds_tokens, rejected

    fake_aws_credentials.py --tokens-file F [--web-identity-token T] [--container-token T] ...

Prints "PORT <n>" as the first line of stdout once it accepts connections. Stops on SIGTERM.
"""

import argparse
import datetime
import hashlib
import hmac
import json
import os
import signal
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROLE = "wfs-node-role"


class State:
    def __init__(self, args):
        self.args = args
        self.lock = threading.Lock()
        self.lifetime = args.lifetime
        self.issued = {}  # token -> {"secret", "expires", "by"}
        self.imds_tokens = set()
        self.stats = {}
        self.fail = {}
        self.n = 0
        self.save()

    def count(self, name):
        self.stats[name] = self.stats.get(name, 0) + 1

    def save(self):
        tmp = self.args.tokens_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.issued, f)
        os.replace(tmp, self.args.tokens_file)

    def issue(self, by):
        with self.lock:
            self.n += 1
            token = "tok-%s-%d" % (by, self.n)
            secret = "secret-%s-%d" % (by, self.n)
            expires = time.time() + self.lifetime
            self.issued[token] = {"secret": secret, "expires": expires, "by": by}
            self.count("issued_" + by)
            self.save()
        when = datetime.datetime.fromtimestamp(expires, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return self.args.access_key_id, secret, token, when


def sigv4_ok(method, raw_path, headers, body, key_id, secret, service):
    """Whether the Authorization of `headers` (names lower-cased) is a SigV4 signature by key_id/secret."""
    auth = headers.get("authorization", "")
    if not auth.startswith("AWS4-HMAC-SHA256 "):
        return False
    parts = dict(p.strip().split("=", 1) for p in auth[len("AWS4-HMAC-SHA256 "):].split(","))
    cred = parts.get("Credential", "").split("/")
    if len(cred) != 5 or cred[0] != key_id or cred[3] != service:
        return False
    signed = parts.get("SignedHeaders", "").split(";")
    path, _, query = raw_path.partition("?")
    pairs = []
    for item in query.split("&") if query else []:
        k, _, v = item.partition("=")
        k, v = urllib.parse.unquote(k), urllib.parse.unquote(v)
        pairs.append((urllib.parse.quote(k, safe="-_.~"), urllib.parse.quote(v, safe="-_.~")))
    canonical_query = "&".join("%s=%s" % kv for kv in sorted(pairs))
    lines = []
    for h in signed:
        v = headers.get(h, "")
        lines.append("%s:%s\n" % (h, " ".join(v.split())))
    payload = headers.get("x-amz-content-sha256") or hashlib.sha256(body).hexdigest()
    canonical = "\n".join([method, path or "/", canonical_query, "".join(lines), ";".join(signed), payload])
    amz_date = headers.get("x-amz-date", "")
    scope = "/".join(cred[1:])
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])

    def h(key, msg):
        return hmac.new(key, msg.encode(), hashlib.sha256).digest()

    k = h(("AWS4" + secret).encode(), cred[1])
    k = h(k, cred[2])
    k = h(k, cred[3])
    k = h(k, "aws4_request")
    want = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
    return hmac.compare_digest(want, parts.get("Signature", ""))


def make_handler(state):
    args = state.args

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *a):
            pass

        def reply(self, status, body, content_type="application/json"):
            data = body.encode() if isinstance(body, str) else body
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def body(self):
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def failing(self, provider):
            status = state.fail.get(provider)
            if status:
                with state.lock:
                    state.count("failed_" + provider)
                self.reply(status, json.dumps({"Code": "Injected", "Message": "injected by the test"}))
                return True
            return False

        def creds_json(self, by, token_key="Token", version=False):
            key_id, secret, token, when = state.issue(by)
            doc = {"AccessKeyId": key_id, "SecretAccessKey": secret, token_key: token, "Expiration": when}
            if version:
                doc["Version"] = 1
            else:
                doc.update({"Code": "Success", "Type": "AWS-HMAC",
                            "LastUpdated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
            return json.dumps(doc)

        def handle_any(self):
            raw = self.path
            path, _, query = raw.partition("?")
            params = dict(urllib.parse.parse_qsl(query, keep_blank_values=True))
            body = self.body()
            with state.lock:
                state.count("requests")
            if path == "/stats":
                with state.lock:
                    out = dict(state.stats)
                    out["imds_tokens"] = len(state.imds_tokens)
                return self.reply(200, json.dumps(out))
            if path == "/control":
                with state.lock:
                    if "lifetime" in params:
                        state.lifetime = float(params["lifetime"])
                    if params.get("expire_all"):
                        for v in state.issued.values():
                            v["expires"] = time.time() - 1
                        state.save()
                    if "fail" in params:
                        if params["fail"]:
                            p, _, status = params["fail"].partition(":")
                            state.fail[p] = int(status)
                        else:
                            state.fail.clear()
                return self.reply(200, "{}")
            # IMDSv2.
            if path == "/latest/api/token":
                if self.command != "PUT" or not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    return self.reply(400, "")
                token = "imds-session-%d" % time.monotonic_ns()
                with state.lock:
                    state.imds_tokens.add(token)
                return self.reply(200, token, "text/plain")
            if path.startswith("/latest/meta-data/iam/security-credentials/"):
                with state.lock:
                    ok = self.headers.get("X-aws-ec2-metadata-token") in state.imds_tokens
                    if not ok:
                        state.count("rejected_imds_v1")
                if not ok:
                    return self.reply(401, "")
                role = path[len("/latest/meta-data/iam/security-credentials/"):]
                if role == "":
                    return self.reply(200, ROLE, "text/plain")
                if role != ROLE:
                    return self.reply(404, "")
                if self.failing("imds"):
                    return
                return self.reply(200, self.creds_json("imds"))
            if path.startswith("/ecs/"):
                if args.container_token and self.headers.get("Authorization") != args.container_token:
                    with state.lock:
                        state.count("rejected_container")
                    return self.reply(401, json.dumps({"message": "bad authorization token"}))
                if self.failing("container"):
                    return
                return self.reply(200, self.creds_json("container"))
            if path == "/process":
                if self.failing("process"):
                    return
                return self.reply(200, self.creds_json("process", "SessionToken", version=True))
            if path == "/" and self.command == "POST":
                form = dict(urllib.parse.parse_qsl(body.decode(), keep_blank_values=True))
                action = form.get("Action")
                if action == "AssumeRoleWithWebIdentity":
                    by = "sts_web"
                    if form.get("WebIdentityToken") != args.web_identity_token or not form.get("RoleArn"):
                        with state.lock:
                            state.count("rejected_" + by)
                        return self.sts_error(400, "InvalidIdentityToken", "the web identity token is not valid")
                elif action == "AssumeRole":
                    by = "sts_assume"
                    if not form.get("RoleArn") or not sigv4_ok("POST", raw, {k.lower(): v for k, v in self.headers.items()},
                                                               body, args.source_key_id, args.source_secret, "sts"):
                        with state.lock:
                            state.count("rejected_" + by)
                        return self.sts_error(403, "SignatureDoesNotMatch", "not signed by the source credentials")
                else:
                    return self.sts_error(400, "InvalidAction", "unknown action")
                if self.failing(by):
                    return
                key_id, secret, token, when = state.issue(by)
                xml = ("<{a}Response xmlns=\"https://sts.amazonaws.com/doc/2011-06-15/\"><{a}Result>"
                       "<Credentials><AccessKeyId>{k}</AccessKeyId><SecretAccessKey>{s}</SecretAccessKey>"
                       "<SessionToken>{t}</SessionToken><Expiration>{w}</Expiration></Credentials>"
                       "</{a}Result></{a}Response>").format(a=action, k=key_id, s=secret, t=token, w=when)
                return self.reply(200, xml, "text/xml")
            return self.reply(404, "")

        def sts_error(self, status, code, message):
            xml = ("<ErrorResponse xmlns=\"https://sts.amazonaws.com/doc/2011-06-15/\"><Error><Type>Sender</Type>"
                   "<Code>%s</Code><Message>%s</Message></Error></ErrorResponse>" % (code, message))
            return self.reply(status, xml, "text/xml")

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = handle_any

    return Handler


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens-file", required=True)
    p.add_argument("--listen-port", type=int, default=0)
    p.add_argument("--access-key-id", default="S3RVER")
    p.add_argument("--lifetime", type=float, default=3600)
    p.add_argument("--web-identity-token", default="eks-projected-token")
    p.add_argument("--container-token", default="")
    p.add_argument("--source-key-id", default="AKIDSOURCE")
    p.add_argument("--source-secret", default="source-secret")
    args = p.parse_args()
    state = State(args)
    server = ThreadingHTTPServer(("127.0.0.1", args.listen_port), make_handler(state))
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    print("PORT %d" % server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
