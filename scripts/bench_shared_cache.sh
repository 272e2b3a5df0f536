#!/usr/bin/env bash
# The shared cache tier (--shared-cache, docs/shared-cache.md): K = 1, 2, 4 inference nodes (mounts
# on this machine, each with its own empty cache directory) read step N, then step N+1, all at
# once, from a WebDAV bucket (nginx) behind a proxy that counts the bytes the origin serves;
# with no tier, and through a WebDAV tier on the same nginx. Measured per run:
#   - origin bytes (counted at the origin's proxy, GET bodies) and their ratio to the bytes the
#     bucket stores;
#   - wall time per node (mean and slowest) for N and for N+1;
#   - every node's files checked against the source (sha256sum) after the timed reads.
#
# The origin's proxy holds every request ORIGIN_LATENCY_MS (20) before forwarding it: a bucket
# across a network answers a request in tens of ms (S3's first byte: 20-50 ms), where this
# loopback nginx answers in one.
#
# Environment: PARAMS (200M: ~400 MB of bf16 a version), NODES ("1 2 4"), ORIGIN_LATENCY_MS, WORK
# (/tmp/wfs-bench-shared), KEEP=1 keeps WORK, WEIGHTFS=path uses a prebuilt binary. Needs root
# or FUSE access, nginx with WebDAV, python3 (scripts/setup.sh installs them).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
params=${PARAMS:-200M}
nodes_list=${NODES:-1 2 4}
work=${WORK:-/tmp/wfs-bench-shared}

"$root/scripts/setup.sh"
if [[ -n "${WEIGHTFS:-}" ]]; then
  wfs=$WEIGHTFS
else
  TARGET=weightfs "$root/scripts/build.sh" >/dev/null
  wfs="$root/build/tools/weightfs"
fi

now() { date +%s.%N; }
secs() { awk "BEGIN { printf \"%.2f\", $2 - $1 }"; }
free_port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 100); do (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; return 1; }
mounted() { awk -v m="$1" '$5 == m { found = 1 } END { exit !found }' /proc/self/mountinfo; }
origin_bytes() {
  curl -s "http://127.0.0.1:$proxy_port/.fault-proxy/stats" |
    /usr/bin/python3 -c "import json,sys; print(json.load(sys.stdin).get('sent_bytes_GET', 0))"
}

pids=()
mounts=()
cleanup() {
  for m in "${mounts[@]}"; do
    if mounted "$m"; then "$wfs" unmount "$m" >/dev/null 2>&1 || umount -l "$m" || true; fi
  done
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [[ "${KEEP:-0}" == 1 ]] || rm -rf "$work"
}
trap cleanup EXIT

mkdir -p "$work"
data="$work/data-$params"
if [[ ! -f "$data/versions.json" ]]; then
  rm -rf "$work"/data-*
  echo "== generating $params params x 2 versions (lr 1e-6), 4 shards"
  bytes=$(/usr/bin/python3 -c "import sys; s=sys.argv[1]; m={'K':1e3,'M':1e6,'B':1e9,'G':1e9,'T':1e12}; print(int(float(s[:-1]) * m[s[-1]] * 2 if s[-1] in m else float(s) * 2))" "$params")
  "$wfs" gen "$data" --params "$params" --versions 1 --lr 1e-6 --shard-size "$((bytes / 4))" --seed 7 >/dev/null
fi

# nginx: the bucket at /bucket, the tier at /tier; the proxy in front of it is the origin.
srv="$work/srv"
rm -rf "$srv"; mkdir -p "$srv/root" "$srv/tmp"
port=$(free_port)
cat >"$srv/nginx.conf" <<EOF
$( [[ $(id -u) == 0 ]] && echo "user root;" )
worker_processes 2;
daemon off;
pid $srv/nginx.pid;
error_log $srv/error.log;
$(ls /etc/nginx/modules-enabled/*dav-ext* >/dev/null 2>&1 && echo "include /etc/nginx/modules-enabled/*dav-ext*.conf;")
events { worker_connections 512; }
http {
  access_log off;
  client_body_temp_path $srv/tmp;
  server {
    listen 127.0.0.1:$port;
    root $srv/root;
    client_max_body_size 0;
    dav_methods PUT DELETE MKCOL COPY MOVE;
    dav_ext_methods PROPFIND OPTIONS;
    create_full_put_path on;
  }
}
EOF
nginx -c "$srv/nginx.conf" & pids+=($!)
wait_port "$port"
latency_ms=${ORIGIN_LATENCY_MS:-20}
/usr/bin/python3 "$root/tests/testing/fault_proxy.py" --listen-port 0 --target "http://127.0.0.1:$port" \
  --stall-rate "$( ((latency_ms > 0)) && echo 1 || echo 0)" --stall-seconds "$(awk "BEGIN { print $latency_ms / 1000 }")" \
  >"$srv/proxy.out" 2>"$srv/proxy.err" & pids+=($!)
for _ in $(seq 100); do grep -q '^PORT ' "$srv/proxy.out" 2>/dev/null && break; sleep 0.1; done
proxy_port=$(awk '/^PORT /{print $2; exit}' "$srv/proxy.out")
direct="http://127.0.0.1:$port/bucket"
origin="http://127.0.0.1:$proxy_port/bucket"
tier="http://127.0.0.1:$port/tier"

"$wfs" init "$direct" >/dev/null
"$wfs" push "$direct" bench/m@n "$data/v000" --cache-dir "$work/cache-push" >/dev/null
"$wfs" push "$direct" bench/m@n1 "$data/v001" --cache-dir "$work/cache-push" >/dev/null
stored=$(du -sb --exclude=.weightfs-tmp "$srv/root/bucket" | cut -f1)
logical=$(du -sb "$data/v000" | cut -f1)
echo "== a version: $((logical / 1000000)) MB in $(ls "$data/v000" | wc -l) files; the bucket stores $((stored / 1000000)) MB for N and N+1; origin latency ${latency_ms} ms a request"
(cd "$data/v000" && sha256sum -- *) >"$work/n.sha256"
(cd "$data/v001" && sha256sum -- *) >"$work/n1.sha256"

# One run: K nodes, with or without the tier. Prints one table row.
run() {
  local k=$1 with=$2
  for m in "${mounts[@]}"; do mounted "$m" && "$wfs" unmount "$m" >/dev/null; done
  mounts=()
  rm -rf "$work"/node-* "$srv/root/tier"
  local opts=()
  [[ "$with" == tier ]] && opts=(--shared-cache "$tier")
  for ((i = 0; i < k; i++)); do
    mkdir -p "$work/node-$i/mnt"
    "$wfs" mount "$origin" "$work/node-$i/mnt" --cache-dir "$work/node-$i/cache" \
      --log-file "$work/node-$i/log" "${opts[@]}" >/dev/null
    mounts+=("$work/node-$i/mnt")
  done
  local before; before=$(origin_bytes)
  for v in n n1; do
    local readers=()
    for ((i = 0; i < k; i++)); do
      ( t0=$(now); cat "$work/node-$i/mnt/bench/m@$v"/* >/dev/null; t1=$(now); echo "$(secs "$t0" "$t1")" >"$work/node-$i/$v.s" ) &
      readers+=($!)
    done
    wait "${readers[@]}"
  done
  local after; after=$(origin_bytes)
  for ((i = 0; i < k; i++)); do
    (cd "$work/node-$i/mnt/bench/m@n" && sha256sum -c --quiet "$work/n.sha256") || { echo "node $i: N differs"; exit 1; }
    (cd "$work/node-$i/mnt/bench/m@n1" && sha256sum -c --quiet "$work/n1.sha256") || { echo "node $i: N+1 differs"; exit 1; }
  done
  local served=$((after - before))
  local n_times n1_times
  n_times=$(cat "$work"/node-*/n.s | awk '{ s += $1; if ($1 > m) m = $1 } END { printf "%.2f / %.2f", s / NR, m }')
  n1_times=$(cat "$work"/node-*/n1.s | awk '{ s += $1; if ($1 > m) m = $1 } END { printf "%.2f / %.2f", s / NR, m }')
  printf "| %d | %-7s | %8.1f | %5.2fx | %5.2fx | %-13s | %-13s |\n" "$k" "$with" "$(awk "BEGIN{print $served/1e6}")" \
    "$(awk "BEGIN{print $served/$stored}")" "$(awk "BEGIN{print $served/$stored/$k}")" "$n_times" "$n1_times"
}

echo
echo "| K | tier    | origin MB | origin / stored | per node | N: mean / max s | N+1: mean / max s |"
echo "|---|---------|----------:|------:|------:|---------------|---------------|"
for k in $nodes_list; do
  run "$k" none
  run "$k" tier
done
