#!/usr/bin/env bash
# Mount benchmark (issue 4): a generated RL-like run of a sharded bf16 model (10 versions after
# the base by default, lr 1e-6) pushed to a local bucket, then read through `weightfs mount`:
#
#   (a) cat of the last version's files from local disk: cold (page cache dropped) and warm
#   (b) cold read through the mount (empty chunk cache, new mount, page cache dropped) vs (a) cold
#   (c) read with the disk chunk cache warm (new mount, same cache directory), vs (a) in the same
#       page-cache state: both cold (dropped), and both warm (the cache files and the source
#       files in the page cache)
#   (d) re-read in the same mount (kernel page cache) vs (a) warm
#
# "Cold" drops the kernel's page cache (echo 3 > /proc/sys/vm/drop_caches: root). Without root
# the cold lines are measured warm and say so.
#   (e) one tensor (the largest) of each shard, cold: bytes fetched from the bucket vs the
#       tensor's bytes (+ the header chunk a reader must parse first)
#   (f) time from `weightfs mount` returning to the first byte of a file
#   (g) peak RSS of the daemon vs --memory-limit
#
# Environment: PARAMS (1B: ~2 GB of bf16 per version), VERSIONS (10 after the base),
# MEMORY_LIMIT (1GiB), WORK (/tmp/wfs-bench-mount), KEEP=1 keeps WORK (the generated data is
# reused by the next run with the same PARAMS and VERSIONS). Needs root or FUSE access.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
params=${PARAMS:-1B}
versions=${VERSIONS:-10}
memory_limit=${MEMORY_LIMIT:-1GiB}
work=${WORK:-/tmp/wfs-bench-mount}

"$root/scripts/setup.sh"
if [[ -n "${WEIGHTFS:-}" ]]; then
  wfs=$WEIGHTFS  # a binary built elsewhere
else
  TARGET=weightfs "$root/scripts/build.sh" >/dev/null
  wfs="$root/build/tools/weightfs"
fi
py=/usr/bin/python3

now() { date +%s.%N; }
secs() { awk "BEGIN { print $2 - $1 }"; }
mbps() { awk "BEGIN { printf \"%.0f\", $1 / 1000000 / $2 }"; }
ratio() { awk "BEGIN { printf \"%.2f\", $1 / $2 }"; }
stat_of() { $py -c "import json,os,sys; j=json.loads(os.getxattr(sys.argv[1],'user.weightfs.stats')); print(eval('j' + sys.argv[2]))" "$1" "$2"; }

mkdir -p "$work"
data="$work/data-$params-$versions"
bucket="$work/bucket-$params-$versions"
if [[ ! -f "$data/versions.json" ]]; then
  rm -rf "$work"/data-* "$work"/bucket-*
  echo "== generating $params params x $((versions + 1)) versions (lr 1e-6)"
  "$wfs" gen "$data" --params "$params" --versions "$versions" --lr 1e-6 --shard-size 500M --seed 21
fi
# The bucket is reused only if it was written by the same codec: the tree of core/ (or, outside
# a git checkout, the binary) is recorded in .complete. A reused bucket of an older encoder once
# measured the old decoder.
codec_id=$(git -C "$root" rev-parse HEAD:core 2>/dev/null || sha256sum "$wfs" | cut -d' ' -f1)
if [[ -n "$(git -C "$root" status --porcelain core 2>/dev/null)" ]]; then
  codec_id=$(sha256sum "$wfs" | cut -d' ' -f1)  # uncommitted codec changes
fi
if [[ "$(cat "$bucket/.complete" 2>/dev/null)" != "$codec_id" ]]; then
  rm -rf "$bucket"
  "$wfs" init "$bucket" >/dev/null
  for ((k = 0; k <= versions; k++)); do
    "$wfs" push "$bucket" "bench/model@v$k" "$data/$(printf v%03d $k)" --no-cache | sed 's/^/   /'
  done
  echo "$codec_id" >"$bucket/.complete"
fi
src="$data/$(printf v%03d "$versions")"
size=$(du -sb "$src" | cut -f1)
mnt="$work/mnt"
cache="$work/cache"
mounted() { awk -v m="$mnt" '$5 == m { found = 1 } END { exit !found }' /proc/self/mountinfo; }
cleanup() {
  if mounted; then "$wfs" unmount "$mnt" >/dev/null || "$wfs" unmount --lazy "$mnt" >/dev/null || true; fi
  [[ "${KEEP:-0}" == 1 ]] || rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$mnt"
mount_fresh() {  # $1: keep the cache directory (1) or empty it (0)
  if mounted; then "$wfs" unmount "$mnt" >/dev/null; fi
  [[ "$1" == 1 ]] || rm -rf "$cache"
  "$wfs" mount "$bucket" "$mnt" --cache-dir "$cache" --memory-limit "$memory_limit" \
    --log-file "$work/mount.log" >/dev/null
}
version="$mnt/bench/model@v$versions"
echo "== last version: $((size / 1000000)) MB in $(ls "$src" | wc -l) files; bucket $(du -sb "$bucket" | cut -f1) bytes for $((versions + 1)) versions"

cold=warm
drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }
if [[ -w /proc/sys/vm/drop_caches ]]; then cold=cold; fi
maybe_drop() { [[ "$cold" == cold ]] && drop_caches || true; }

# (a) local disk, cold and warm.
maybe_drop
t0=$(now); cat "$src"/* >/dev/null; t1=$(now); a_cold=$(secs "$t0" "$t1")
cat "$src"/* >/dev/null
t0=$(now); cat "$src"/* >/dev/null; t1=$(now); a=$(secs "$t0" "$t1")

# (f) first byte after mount returns, and (b) cold.
mount_fresh 0
maybe_drop
first_file=$(ls "$src" | grep safetensors | head -1)
t0=$(now); head -c 1 "$version/$first_file" >/dev/null; t1=$(now); f=$(secs "$t0" "$t1")
t0=$(now); cat "$version"/* >/dev/null; t1=$(now); b=$(secs "$t0" "$t1")
b_fetched=$(stat_of "$mnt" "['bucket']['bytes_received']")
# (d) page cache, against (a) warm measured alternately with it (best of 3 each: on a small
# machine the generated versions do not all fit in memory, so (a) must be re-warmed).
min() { awk "BEGIN { print ($1 < $2) ? $1 : $2 }"; }
d=1e9
for _ in 1 2 3; do
  cat "$src"/* >/dev/null
  t0=$(now); cat "$src"/* >/dev/null; t1=$(now); a=$(min "$(secs "$t0" "$t1")" "$a")
  cat "$version"/* >/dev/null
  t0=$(now); cat "$version"/* >/dev/null; t1=$(now); d=$(min "$(secs "$t0" "$t1")" "$d")
done
g_peak=$(stat_of "$mnt" "['peak_rss_bytes']")
peak() { local p; p=$(stat_of "$mnt" "['peak_rss_bytes']"); g_peak=$(( g_peak > p ? g_peak : p )); }
# (c) disk cache warm: cache files cold (dropped), then cache files in the page cache.
mount_fresh 1
maybe_drop
t0=$(now); cat "$version"/* >/dev/null; t1=$(now); c_cold=$(secs "$t0" "$t1")
c_fetched=$(stat_of "$mnt" "['bucket']['bytes_received']")
peak
mount_fresh 1
cat "$src"/* >/dev/null
t0=$(now); cat "$version"/* >/dev/null; t1=$(now); c=$(secs "$t0" "$t1")
peak

# (e) one tensor per shard, cold.
mount_fresh 0
e_out=$($py - "$version" <<'PY'
import json, os, struct, sys
version = sys.argv[1]
needed = 0
for name in sorted(os.listdir(version)):
    if not name.endswith(".safetensors"):
        continue
    with open(os.path.join(version, name), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        tensors = [(v["data_offsets"][1] - v["data_offsets"][0], k, v) for k, v in header.items() if k != "__metadata__"]
        size, tname, info = max(tensors)
        f.seek(8 + n + info["data_offsets"][0])
        left = size
        while left:
            got = f.read(min(left, 1 << 20))
            assert got, "short read"
            left -= len(got)
        needed += size + 8 + n
stats = json.loads(os.getxattr(version.rsplit("/", 2)[0], "user.weightfs.stats"))
print(needed, stats["bucket"]["bytes_received"], stats["reader"]["materializations"])
PY
)
read -r e_needed e_fetched e_chunks <<<"$e_out"
peak
limit_bytes=$($py -c "
import re,sys; s=sys.argv[1]; m=re.fullmatch(r'([0-9.]+)([KMGT]?)(i?)B?', s); n=float(m[1]); b=1024 if m[3] else 1000
print(int(n * b ** ' KMGT'.index(m[2] or ' ')))" "$memory_limit")

echo
printf "(a) local disk, %s:        %6.2f s  %6s MB/s\n" "$cold" "$a_cold" "$(mbps "$size" "$a_cold")"
printf "    local disk, warm:        %6.2f s  %6s MB/s\n" "$a" "$(mbps "$size" "$a")"
printf "(b) mount, cold (%s):      %6.2f s  %6s MB/s  = %sx (a) %s   (target >= 0.4)  fetched %s MB\n" "$cold" "$b" "$(mbps "$size" "$b")" "$(ratio "$a_cold" "$b")" "$cold" "$((b_fetched / 1000000))"
printf "(c) mount, disk cache (%s): %6.2f s  %6s MB/s  = %sx (a) %s   (target >= 0.7)  fetched %s B\n" "$cold" "$c_cold" "$(mbps "$size" "$c_cold")" "$(ratio "$a_cold" "$c_cold")" "$cold" "$c_fetched"
printf "    mount, disk cache (warm): %6.2f s  %6s MB/s  = %sx (a) warm\n" "$c" "$(mbps "$size" "$c")" "$(ratio "$a" "$c")"
printf "(d) mount, page cache:       %6.2f s  %6s MB/s  = %sx (a) warm   (target >= 0.9)\n" "$d" "$(mbps "$size" "$d")" "$(ratio "$a" "$d")"
printf "(e) one tensor per shard:    fetched %s B for %s B of tensors + headers = %sx (target <= 1.1); %s chunks materialized\n" "$e_fetched" "$e_needed" "$(ratio "$e_fetched" "$e_needed")" "$e_chunks"
printf "(f) mount to first byte:     %6.1f ms   (target <= 100)\n" "$(awk "BEGIN { print $f * 1000 }")"
printf "(g) daemon peak RSS:         %s MB of --memory-limit %s MB = %sx\n" "$((g_peak / 1000000))" "$((limit_bytes / 1000000))" "$(ratio "$g_peak" "$limit_bytes")"
