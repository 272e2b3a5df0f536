#!/usr/bin/env bash
# Bucket benchmark: a generated 10-version RL-like run of a ~1 GB sharded bf16 model pushed to
# a bucket and pulled back, with baselines measured in the same run on the same files.
#
#   scripts/bench_bucket.sh [local] [http] [s3]        (default: local)
#
# For each backend (local directory; nginx WebDAV on loopback; s3rver on loopback):
#   push of the base and of every delta version, pull of every version (SHA-256 of every file
#   compared with the source), a cold pull of the last version (bytes received vs the payload
#   bytes its chains need), and a warm pull of version N+1 with N in the cache (bytes received
#   vs N+1's stored bytes). Baselines: `cp` of the same files and `zstd -3 -T0` of them.
# Environment: PARAMS (500M), VERSIONS (9 after the base), WORK (/tmp/wfs-bench), KEEP=1 keeps
# WORK's bucket and caches, WEIGHTFS=path uses that binary instead of building one.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
params=${PARAMS:-500M}
versions=${VERSIONS:-9}
work=${WORK:-/tmp/wfs-bench}
backends=("$@")
((${#backends[@]})) || backends=(local)

"$root/scripts/setup.sh"
if [[ -n "${WEIGHTFS:-}" ]]; then
  wfs=$WEIGHTFS  # a binary built elsewhere
else
  TARGET=weightfs "$root/scripts/build.sh" >/dev/null
  wfs="$root/build/tools/weightfs"
fi

now() { date +%s.%N; }
secs() { awk "BEGIN { print $2 - $1 }"; }
mbps() { awk "BEGIN { print $1 / 1000000 / $2 }"; }
ratio() { awk "BEGIN { print $1 / $2 }"; }
# `--stats` line -> received bytes / payload bytes fetched
stat_field() { sed -n "s/.*$1 \([0-9]*\).*/\1/p" "$2" | tail -1; }

mkdir -p "$work"
data="$work/data"
if [[ ! -f "$data/versions.json" ]]; then
  rm -rf "$data"
  echo "== generating $params params x $((versions + 1)) versions (lr 1e-6, 3 shards)"
  "$wfs" gen "$data" --params "$params" --versions "$versions" --lr 1e-6 --shard-size 400M --seed 11
fi
last=$(printf "v%03d" "$versions")
prev=$(printf "v%03d" $((versions - 1)))
size=$(du -sb "$data/v000" | cut -f1)
echo "== one version: $size bytes ($(ls "$data/v000" | wc -l) files)"

# Baselines, on warm page cache like everything below.
cat "$data"/v000/* >/dev/null
rm -rf "$work/cp"; t0=$(now); cp -r "$data/v000" "$work/cp"; sync "$work/cp"/*; t1=$(now)
cp_s=$(secs "$t0" "$t1"); rm -rf "$work/cp"
t0=$(now); zstd -3 -T0 -q -c "$data"/v000/*.safetensors >"$work/z.zst"; t1=$(now)
zstd_s=$(secs "$t0" "$t1"); zstd_bytes=$(stat -c %s "$work/z.zst"); rm -f "$work/z.zst"
printf "baseline cp:        %7.1f MB/s\n" "$(mbps "$size" "$cp_s")"
printf "baseline zstd -3:   %7.1f MB/s (-T0, %.2fx smaller)\n" "$(mbps "$size" "$zstd_s")" "$(ratio "$size" "$zstd_bytes")"

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [[ "${KEEP:-0}" == 1 ]] || rm -rf "$work/bucket" "$work/srv" "$work/pull" "$work/cache"*
}
trap cleanup EXIT

free_port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 100); do (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; return 1; }

for backend in "${backends[@]}"; do
  rm -rf "$work/bucket" "$work/srv" "$work/cache"* "$work/pull"
  mkdir -p "$work/srv"
  extra=()
  case "$backend" in
    local) url="$work/bucket" ;;
    http)
      port=$(free_port)
      mkdir -p "$work/srv/root"
      cat >"$work/srv/nginx.conf" <<EOF
$( [[ $(id -u) == 0 ]] && echo "user root;" )
worker_processes 2;
daemon off;
pid $work/srv/nginx.pid;
error_log $work/srv/error.log;
$(ls /etc/nginx/modules-enabled/*dav-ext* >/dev/null 2>&1 && echo "include /etc/nginx/modules-enabled/*dav-ext*.conf;")
events { worker_connections 256; }
http {
  access_log off;
  client_body_temp_path $work/srv/tmp;
  server {
    listen 127.0.0.1:$port;
    root $work/srv/root;
    client_max_body_size 0;
    dav_methods PUT DELETE MKCOL COPY MOVE;
    dav_ext_methods PROPFIND OPTIONS;
    create_full_put_path on;
  }
}
EOF
      nginx -c "$work/srv/nginx.conf" & pids+=($!)
      wait_port "$port"
      url="http://127.0.0.1:$port/bucket" ;;
    s3)
      port=$(free_port)
      # s3rver makes listing continuation tokens with DES: Node 20 needs its legacy OpenSSL provider.
      NODE_OPTIONS=--openssl-legacy-provider s3rver --directory "$work/srv" --port "$port" \
        --address 127.0.0.1 --silent --configure-bucket bench & pids+=($!)
      wait_port "$port"
      export AWS_ACCESS_KEY_ID=S3RVER AWS_SECRET_ACCESS_KEY=S3RVER AWS_REGION=us-east-1
      url="s3://bench/run"; extra=(--endpoint "http://127.0.0.1:$port") ;;
    *) echo "unknown backend $backend (local, http, s3)"; exit 2 ;;
  esac
  echo "== backend $backend: $url"
  "$wfs" init "$url" "${extra[@]}" >/dev/null
  t0=$(now)
  "$wfs" push "$url" bench/m@v000 "$data/v000" "${extra[@]}" --cache-dir "$work/cache-push" >"$work/push.log"
  t1=$(now); base_s=$(secs "$t0" "$t1")
  t0=$(now)
  for k in $(seq 1 "$versions"); do
    v=$(printf "v%03d" "$k")
    "$wfs" push "$url" "bench/m@$v" "$data/$v" "${extra[@]}" --cache-dir "$work/cache-push" >>"$work/push.log"
  done
  t1=$(now); delta_s=$(secs "$t0" "$t1")
  printf "push base:          %7.1f MB/s  (%.2fx cp, %.2fx zstd -3)\n" "$(mbps "$size" "$base_s")" \
    "$(ratio "$cp_s" "$base_s")" "$(ratio "$zstd_s" "$base_s")"
  per=$(awk "BEGIN { print $delta_s / $versions }")
  printf "push delta version: %7.1f MB/s  (%.2fx cp, %.2fx zstd -3; %.2f s each)\n" "$(mbps "$size" "$per")" \
    "$(ratio "$cp_s" "$per")" "$(ratio "$zstd_s" "$per")" "$per"
  "$wfs" log "$url" "${extra[@]}" | tail -n 3

  # Cold pull of the last version: bytes received vs the payloads its chains need.
  t0=$(now)
  "$wfs" pull "$url" "bench/m@$last" "$work/pull" "${extra[@]}" --cache-dir "$work/cache-cold" --stats 2>"$work/cold.log" >/dev/null
  t1=$(now); cold_s=$(secs "$t0" "$t1")
  recv=$(stat_field "received" "$work/cold.log"); need=$(sed -n 's/.*payloads fetched [0-9]* (\([0-9]*\) bytes).*/\1/p' "$work/cold.log")
  printf "pull cold:          %7.1f MB/s  (%.2fx cp, %.2fx zstd -3); received %s bytes = %.3fx what its chains need\n" \
    "$(mbps "$size" "$cold_s")" "$(ratio "$cp_s" "$cold_s")" "$(ratio "$zstd_s" "$cold_s")" "$recv" "$(ratio "$recv" "$need")"
  (cd "$data/$last" && sha256sum * | sort) >"$work/sha-src"; (cd "$work/pull" && sha256sum * | sort) >"$work/sha-pull"
  cmp -s "$work/sha-src" "$work/sha-pull" && echo "  $last: SHA-256 of every file equals the source" || { echo "  $last: SHA-256 MISMATCH"; exit 1; }
  rm -rf "$work/pull"

  # Follow the run: pull every version in order with one cache (what a node does), check each.
  stored_last=$("$wfs" log "$url" bench/m --json "${extra[@]}" | /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)[-1]["stored_bytes"])')
  t0=$(now)
  for k in $(seq 0 "$versions"); do
    v=$(printf "v%03d" "$k")
    "$wfs" pull "$url" "bench/m@$v" "$work/pull" "${extra[@]}" --cache-dir "$work/cache-follow" --stats 2>"$work/follow.log" >/dev/null
    (cd "$data/$v" && sha256sum * | sort) >"$work/sha-src"; (cd "$work/pull" && sha256sum * | sort) >"$work/sha-pull"
    cmp -s "$work/sha-src" "$work/sha-pull" || { echo "  $v: SHA-256 MISMATCH"; exit 1; }
    rm -rf "$work/pull"
  done
  t1=$(now)
  recv=$(stat_field "received" "$work/follow.log")
  echo "  all $((versions + 1)) versions pulled back: SHA-256 of every file equals the source"
  printf "pull N+1 with N cached: received %s bytes = %.3fx the %s bytes N+1 stored\n" "$recv" "$(ratio "$recv" "$stored_last")" "$stored_last"
  du -sb "$work/srv" "$work/bucket" 2>/dev/null | awk '{s+=$1} END {printf "bucket size: %d bytes for %d versions = %.2fx one version\n", s, '"$versions"'+1, s/'"$size"'}'
done
