#!/usr/bin/env bash
# One RL step, end to end, each part against what it replaces, in one run: the table of
# min / median / max seconds over RUNS runs (each run measures weightfs and then its baseline,
# one after the other, so both see the same machine state) and the ratio of the medians.
#
# The model: `weightfs gen` (PARAMS, bf16, 500M shards, lr LR, seed 5), versions v0..v4. A
# local bucket holds v0 (base) + v1, v2, v3 pushed as deltas: N = v3; N+1 = v4 is at delta
# chain depth 4 (FULL + 4 deltas) once published.
#
#  1 save       the trainer's mount holds N (read once through it: N is in its chunk cache);
#               mkdir MNT/model@v4, cp N+1's files into the draft, `weightfs commit`
#               | cp of the same files to a local directory + sync. SAVE_FILES=weights copies
#               the *.safetensors shards only (config.json and the shard index are
#               byte-identical in N and N+1; the draft inherits them from N): for binaries
#               between 05aa40f and aec06db, where a draft holding a file of at most one chunk
#               fails to commit ("stat of staging file ...: Bad file descriptor"). A control
#               line beside the table: the same files copied by dd bs=1M (through a user-space
#               buffer, as the daemon copies a FUSE write) + sync.
#  2 push       `weightfs push` of N+1's files with --parent N into a copy of the bucket (the
#               push cache holds N as references to N's files, as a trainer that pushed N has)
#               | zstd -3 -T0 of the same bytes to a file
#  3 hold N     the inference node's mount read N whole; page cache dropped; cat N+1's files
#               | cat of N+1's files from local disk, page cache dropped (cold cat)
#  4 N+1 cached as 3, on a new mount whose disk cache has N+1 (3 read it); page cache dropped
#               | cold cat
#  5 cold       new mount, empty cache directory, page cache dropped: the bucket's packs are
#               read from disk, every chunk is FULL + 4 deltas | cold cat
#  6 patch      `weightfs patch` N -> N+1 (idx/val safetensors) with only N in the cache
#               | numpy: each shard of N and N+1 as uint16 (np.fromfile), idx = flatnonzero(a != b),
#               val = b[idx], both written to files
#  7 re-read    cat N+1's files through the mount, page cache warm | warm cat of local files
#  8 mmap       mmap each safetensors file, parse its header (8-byte LE length + JSON), copy
#               every tensor out of the map (what a loader does; torch is not needed: numpy +
#               mmap); page cache warm, time inside python | the same on the local files
#
# Rows 1, 2 and 6 run with the page cache warm (the source files of a save are in memory, as
# after a trainer wrote them); every timed part starts after a `sync`. Rows 3-5 also report the
# bytes the mount received from the bucket (median over runs).
#
# Environment: PARAMS (1B: ~2 GB of bf16), LR (1e-6: ~1.2% of elements change per step), RUNS
# (3), WARM_RUNS (rows 7, 8: 3 x RUNS), COLD_SETTLE (rows 3-5: 5 s, see drop_caches),
# SAVE_FILES (all, or weights: row 1), WORK (/tmp/wfs-bench-step), KEEP=1 keeps WORK (the
# generated data, the buckets and caches are then reused by the next run with the same PARAMS,
# LR and binary), WEIGHTFS=path uses a prebuilt binary. Needs root (FUSE, and echo 3 > /proc/sys/vm/drop_caches for the cold rows),
# zstd and python3-numpy (scripts/setup.sh installs both). Unmounting: `weightfs unmount`
# (fusermount3 -u, then it waits for the daemon to exit). PARAMS=1B RUNS=3 takes ~6 minutes on
# the 2-core VM (~1.5 of them generating and pushing the versions).
set -Eeuo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
params=${PARAMS:-1B}
lr=${LR:-1e-6}
runs=${RUNS:-3}
warm_runs=${WARM_RUNS:-$((3 * runs))}
cold_settle=${COLD_SETTLE:-5}  # (see drop_caches)
work=${WORK:-/tmp/wfs-bench-step}
save_files=${SAVE_FILES:-all}
py=/usr/bin/python3
script_t0=$(date +%s.%N)

die() { echo "bench_step: $*" >&2; exit 1; }
trap 'echo "bench_step: failed at line $LINENO: $BASH_COMMAND" >&2' ERR
[[ "$runs" =~ ^[1-9][0-9]*$ ]] || die "RUNS must be a positive integer (got '$runs')"
[[ "$warm_runs" =~ ^[1-9][0-9]*$ ]] || die "WARM_RUNS must be a positive integer (got '$warm_runs')"
[[ "$cold_settle" =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "COLD_SETTLE must be a number of seconds (got '$cold_settle')"
[[ "$save_files" == weights || "$save_files" == all ]] || die "SAVE_FILES must be weights or all (got '$save_files')"
[[ -w /proc/sys/vm/drop_caches ]] || die "needs root: rows 3-5 drop the page cache (echo 3 > /proc/sys/vm/drop_caches)"

"$root/scripts/setup.sh" >/dev/null
if [[ -n "${WEIGHTFS:-}" ]]; then
  wfs=$WEIGHTFS
  [[ -x "$wfs" ]] || die "WEIGHTFS=$wfs is not an executable"
else
  TARGET=weightfs "$root/scripts/build.sh" >/dev/null
  wfs="$root/build/tools/weightfs"
fi
command -v zstd >/dev/null || die "zstd not found (apt-get install zstd)"
$py -c "import numpy" 2>/dev/null || die "$py has no numpy (apt-get install python3-numpy)"

now() { date +%s.%N; }
since() { awk "BEGIN { printf \"%.4f\", $(now) - $1 }"; }
# CPU seconds the whole machine has spent busy (every core, /proc/stat: user, nice, system, irq
# and softirq), and those of one process (utime + stime): row 1 says where a save's CPU goes.
busy_cpu() { awk -v hz="$(getconf CLK_TCK)" '/^cpu / { printf "%.2f", ($2 + $3 + $4 + $7 + $8) / hz }' /proc/stat; }
proc_cpu() { awk -v hz="$(getconf CLK_TCK)" '{ sub(/^.*\) /, ""); printf "%.2f", ($12 + $13) / hz }' "/proc/$1/stat"; }
daemon_pid() { $py -c "import os,sys; print(os.getxattr(sys.argv[1], 'user.weightfs.pid').decode())" "$1"; }
say() { echo "== $*" >&2; }
# The cold rows drop the page cache and then wait COLD_SETTLE seconds, both sides alike: on a VM
# whose host takes the guest's free memory back (virtio-balloon free page reporting, as on the
# benchmark VM: reported ~2 s after it is freed), memory the kernel has just freed is cheap to
# fill again and memory it freed earlier costs a host page fault per page (touching 2 GB of it:
# ~2 s more). Timed at once after the drop, a read got some of each, by the luck of its timing
# (cold cat of N+1: 0.9 to 2.8 s); after the wait, every new page is of the second kind, as on a
# node whose free memory has been free a while. The line "fresh memory" says what it costs here.
drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; sleep "$cold_settle"; }
received() { $py -c "import json,os,sys; print(json.loads(os.getxattr(sys.argv[1], 'user.weightfs.stats'))['bucket']['bytes_received'])" "$1"; }
stat_of() { $py -c "import json,os,sys; j=json.loads(os.getxattr(sys.argv[1],'user.weightfs.stats')); print(eval('j' + sys.argv[2]))" "$1" "$2"; }
# Waits (at most 120 s) until the mount's local copies of the files read whole are written
# (fs/whole_files.h: they start once reads pause), so that they do not run under a baseline
# timed next; prints how long it waited.
settle() {
  local t0; t0=$(now)
  for _ in $(seq 1200); do
    [[ "$($py -c "import json,os,sys; j=json.loads(os.getxattr(sys.argv[1], 'user.weightfs.stats')); print(j.get('whole_files', {}).get('queue_depth', 0))" "$1")" == 0 ]] && break
    sleep 0.1
  done
  since "$t0"
}
stored() { "$wfs" log "$1" bench/model --json | $py -c "import json,sys; print([v for v in json.load(sys.stdin) if v['version'] == sys.argv[1]][0]['stored_bytes'])" "$2"; }

mkdir -p "$work"
mnt="$work/mnt"
run="$work/run"  # the state of one run: copies of the templates, outputs
mounted() { awk -v m="$1" '$5 == m { found = 1 } END { exit !found }' /proc/self/mountinfo; }
mount_at() {  # BUCKET CACHE_DIR
  "$wfs" mount "$1" "$mnt" --cache-dir "$2" --log-file "$work/mount.log" >/dev/null
}
unmount_mnt() {
  if mounted "$mnt"; then "$wfs" unmount "$mnt" >/dev/null; fi
}
cleanup() {
  if mounted "$mnt"; then
    "$wfs" unmount --keep-drafts "$mnt" >/dev/null 2>&1 || fusermount3 -uz "$mnt" 2>/dev/null || umount -l "$mnt" || true
  fi
  if [[ "${KEEP:-0}" == 1 ]]; then rm -rf "$run"; else rm -rf "$work"; fi
}
trap cleanup EXIT
cleanup_run() { unmount_mnt; rm -rf "$run"; mkdir -p "$run"; }
mkdir -p "$mnt"
unmount_mnt

# --- The data: v000..v004 (N = v003, N+1 = v004).
data="$work/data-$params-$lr"
if [[ ! -f "$data/versions.json" ]]; then
  rm -rf "$work"/data-* "$work"/tpl-*
  say "generating $params params x 5 versions (lr $lr)"
  "$wfs" gen "$data" --params "$params" --versions 4 --lr "$lr" --shard-size 500M --seed 5 >&2
fi
src="$data/v004"  # N+1
srcN="$data/v003" # N

# --- Templates, copied per run with cp -al (hard links: a bucket's and a cache's files are only
# ever created, renamed into place or unlinked, never written in place, so a linked copy is an
# independent one). Rebuilt when the binary changes.
#   bucket-N     v0..v3 (N)          cache-push  push's references to v000..v003's files
#   bucket-N1    v0..v4 (N+1)        cache-N     a mount's chunk cache after reading N
tpl="$work/tpl-$params-$lr"
stamp="$(sha256sum "$wfs" | cut -d' ' -f1) $params $lr"
if [[ "$(cat "$tpl/.complete" 2>/dev/null)" != "$stamp" ]]; then
  rm -rf "$work"/tpl-*
  mkdir -p "$tpl"
  say "pushing v0..v3 (N) to a local bucket"
  "$wfs" init "$tpl/bucket-N" >/dev/null
  for k in 0 1 2 3; do
    parent=()
    ((k == 0)) || parent=(--parent "v$((k - 1))")
    "$wfs" push "$tpl/bucket-N" "bench/model@v$k" "$data/v00$k" "${parent[@]}" --cache-dir "$tpl/cache-push" | sed 's/^/   /' >&2
  done
  say "pushing v4 (N+1) to a copy of it"
  cp -al "$tpl/bucket-N" "$tpl/bucket-N1"
  cp -al "$tpl/cache-push" "$tpl/cache-tmp"
  "$wfs" push "$tpl/bucket-N1" bench/model@v4 "$src" --parent v3 --cache-dir "$tpl/cache-tmp" | sed 's/^/   /' >&2
  rm -rf "$tpl/cache-tmp"
  say "reading N through a mount (its cache then holds N)"
  mount_at "$tpl/bucket-N" "$tpl/cache-N"
  cat "$mnt/bench/model@v3"/* >/dev/null
  unmount_mnt
  echo "$stamp" >"$tpl/.complete"
fi

size=$(du -sb "$src" | cut -f1)
nfiles=$(ls "$src" | wc -l)
stored_n1=$(stored "$tpl/bucket-N1" v4)
stored_v0=$(stored "$tpl/bucket-N1" v0)
say "N+1: $((size / 1000000)) MB in $nfiles files; stored as a delta: $((stored_n1 / 1000)) kB (base v0: $((stored_v0 / 1000000)) MB); $runs runs"

declare -A W B X  # row -> " seconds..." of weightfs, of the baseline; extra numbers
add() { local -n arr=$1; arr[$2]+=" $3"; }

# The python helpers of rows 6 and 8.
cat >"$work/numpy_diff.py" <<'EOF'
# Baseline of row 6: idx/val of every element that differs between N's and N+1's shards.
import os, sys
import numpy as np
old, new, out = sys.argv[1:4]
for name in sorted(os.listdir(new)):
    if not name.endswith(".safetensors"):
        continue
    a = np.fromfile(os.path.join(old, name), dtype=np.uint16)
    b = np.fromfile(os.path.join(new, name), dtype=np.uint16)
    n = min(a.size, b.size)
    idx = np.flatnonzero(a[:n] != b[:n])
    val = b[idx]
    idx.tofile(os.path.join(out, name + ".idx"))
    val.tofile(os.path.join(out, name + ".val"))
EOF
cat >"$work/mmap_load.py" <<'EOF'
# Row 8: a loader's mmap of every safetensors file of DIR, every tensor copied out of the map
# (torch-free: mmap + numpy). Prints the seconds it took (after python and numpy started).
import json, mmap, os, struct, sys, time
import numpy as np
d = sys.argv[1]
t0 = time.perf_counter()
copied = 0
for name in sorted(os.listdir(d)):
    if not name.endswith(".safetensors"):
        continue
    with open(os.path.join(d, name), "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        (n,) = struct.unpack("<Q", m[:8])
        header = json.loads(m[8:8 + n])
        for key, info in header.items():
            if key == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            view = np.frombuffer(m, dtype=np.uint8, count=end - begin, offset=8 + n + begin)
            tensor = view.copy()
            copied += tensor.size
            del view, tensor
        m.close()
print("%.4f %d" % (time.perf_counter() - t0, copied))
EOF

# --- Row 1: save N+1 into a draft of the trainer's mount | cp + sync.
say "row 1: save (cp into a draft + commit | cp + sync; $save_files files)"
if [[ "$save_files" == all ]]; then saved=("$src"/*); else saved=("$src"/*.safetensors); fi
for ((r = 1; r <= runs; r++)); do
  cleanup_run
  cp -al "$tpl/bucket-N" "$run/bucket"
  cp -al "$tpl/cache-N" "$run/cache"
  mount_at "$run/bucket" "$run/cache"
  cat "$mnt/bench/model@v3"/* >/dev/null  # the trainer holds N
  cat "${saved[@]}" >/dev/null             # N+1's files are in the page cache, as after a save
  sync
  pid=$(daemon_pid "$mnt")
  busy0=$(busy_cpu)
  daemon0=$(proc_cpu "$pid")
  t0=$(now)
  mkdir "$mnt/bench/model@v4"
  cp "${saved[@]}" "$mnt/bench/model@v4/"
  t_cp=$(since "$t0")
  "$wfs" commit "$mnt/bench/model@v4" >"$run/commit.out" 2>&1 || { cat "$run/commit.out" >&2; die "weightfs commit failed (log: $work/mount.log)"; }
  add W 1 "$(since "$t0")"
  add X 1cp "$t_cp"
  add X 1busy "$(awk "BEGIN { print $(busy_cpu) - $busy0 }")"
  add X 1daemon "$(awk "BEGIN { print $(proc_cpu "$pid") - $daemon0 }")"
  unmount_mnt
  add X 1stored "$(stored "$run/bucket" v4)"
  cat "${saved[@]}" >/dev/null
  sync
  busy0=$(busy_cpu)
  t0=$(now)
  mkdir "$run/local"
  cp "${saved[@]}" "$run/local/"
  sync
  add B 1 "$(since "$t0")"
  add X 1busy_local "$(awk "BEGIN { print $(busy_cpu) - $busy0 }")"
  # A control, not the baseline: the same copy through a user-space buffer (dd bs=1M, as the
  # mount's daemon copies a FUSE write into its staging file), where cp copies in the kernel
  # (copy_file_range). On a VM whose fresh page-cache memory is slow, this is what moves.
  rm -rf "$run/local"
  sync
  t0=$(now)
  mkdir "$run/local"
  for f in "${saved[@]}"; do dd if="$f" of="$run/local/$(basename "$f")" bs=1M status=none; done
  sync
  add X 1dd "$(since "$t0")"
done

# --- Row 2: weightfs push | zstd -3 -T0.
say "row 2: push (weightfs push --parent N | zstd -3 -T0)"
for ((r = 1; r <= runs; r++)); do
  cleanup_run
  cp -al "$tpl/bucket-N" "$run/bucket"
  cp -al "$tpl/cache-push" "$run/cache"
  cat "$srcN"/* "$src"/* >/dev/null  # the trainer's files of N and N+1 are in the page cache
  sync
  t0=$(now)
  "$wfs" push "$run/bucket" bench/model@v4 "$src" --parent v3 --cache-dir "$run/cache" >"$run/push.out" 2>&1 || { cat "$run/push.out" >&2; die "weightfs push failed"; }
  add W 2 "$(since "$t0")"
  add X 2stored "$(stored "$run/bucket" v4)"
  sync
  t0=$(now)
  zstd -3 -T0 -q -c "$src"/* >"$run/n1.zst"
  add B 2 "$(since "$t0")"
  add X 2zstd "$(stat -c %s "$run/n1.zst")"
done

# --- Rows 3 and 4: the inference node holds N; reads N+1 (3), then from its disk cache (4).
cold_cat() { drop_caches; local t0; t0=$(now); cat "$src"/* >/dev/null; since "$t0"; }
# The disk alone: N+1's files read around the page cache (O_DIRECT, one 4 MiB buffer reused).
direct_read() { drop_caches; local t0 f; t0=$(now); for f in "$src"/*; do dd if="$f" of=/dev/null bs=4M iflag=direct status=none; done; since "$t0"; }
# Seconds to touch 1 GiB of new anonymous memory, after the same wait.
fresh_gib() { drop_caches; $py -c "import time, numpy as np; t = time.perf_counter(); a = np.ones(1 << 30, np.uint8); print(f'{time.perf_counter() - t:.3f}')"; }
say "rows 3, 4: holding N, read N+1; N+1 in the disk cache (| cold cat)"
for ((r = 1; r <= runs; r++)); do
  cleanup_run
  cp -al "$tpl/cache-N" "$run/cache"
  mount_at "$tpl/bucket-N1" "$run/cache"
  cat "$mnt/bench/model@v3"/* >/dev/null  # the node holds N
  drop_caches
  before=$(received "$mnt")
  t0=$(now)
  cat "$mnt/bench/model@v4"/* >/dev/null
  add W 3 "$(since "$t0")"
  add X 3recv "$(($(received "$mnt") - before))"
  add X 3settle "$(settle "$mnt")"
  add B 3 "$(cold_cat)"
  unmount_mnt
  mount_at "$tpl/bucket-N1" "$run/cache"
  drop_caches
  t0=$(now)
  cat "$mnt/bench/model@v4"/* >/dev/null
  add W 4 "$(since "$t0")"
  add X 4recv "$(received "$mnt")"
  unmount_mnt
  add B 4 "$(cold_cat)"
  add X direct "$(direct_read)"
  add X fresh "$(fresh_gib)"
done

# --- Row 5: cold read, empty cache.
say "row 5: cold read, empty cache (| cold cat)"
for ((r = 1; r <= runs; r++)); do
  cleanup_run
  mount_at "$tpl/bucket-N1" "$run/cache"
  drop_caches
  t0=$(now)
  cat "$mnt/bench/model@v4"/* >/dev/null
  add W 5 "$(since "$t0")"
  add X 5recv "$(received "$mnt")"
  add X 5settle "$(settle "$mnt")"
  depth=$(stat_of "$mnt" "['materializer']['chain_depth_max']")
  unmount_mnt
  add B 5 "$(cold_cat)"
done

# --- Row 6: weightfs patch N -> N+1 with only N cached | numpy idx/val.
say "row 6: patch N -> N+1 (weightfs patch | numpy diff)"
patch_run() {  # the cache copy is fresh each time: patch caches N+1's chunks
  rm -rf "$run/cache" "$run/patches"
  cp -al "$tpl/cache-N" "$run/cache"
  sync
  local t0; t0=$(now)
  "$wfs" patch "$tpl/bucket-N1" bench/model@v4 --from v3 -o "$run/patches" --cache-dir "$run/cache" >/dev/null
  since "$t0"
}
numpy_run() {
  rm -rf "$run/np"; mkdir -p "$run/np"
  sync
  local t0; t0=$(now)
  $py "$work/numpy_diff.py" "$srcN" "$src" "$run/np"
  since "$t0"
}
cleanup_run
patch_run >/dev/null; numpy_run >/dev/null  # warm-up: both read from the page cache
for ((r = 1; r <= runs; r++)); do
  add W 6 "$(patch_run)"
  add B 6 "$(numpy_run)"
done
X[6patch]=$(du -sb "$run/patches" | cut -f1)
X[6np]=$(du -sb "$run/np" | cut -f1)

# --- Rows 7 and 8: warm re-read and mmap of every tensor, through the mount | local files.
# WARM_RUNS (3 x RUNS) passes, each the mount then the local files: a pass takes ~0.2 s, and
# one pass in a few is 2x slower on either side (the other core busy, a host's hiccup); with 3
# passes, the medians of row 8 for b7e80da were 0.41 / 0.19 s in one run, 0.19 / 0.18 s in the
# next on a new machine.
say "rows 7, 8: warm re-read, mmap + copy of every tensor (| the same on local files)"
cleanup_run
cp -al "$tpl/cache-N" "$run/cache"
mount_at "$tpl/bucket-N1" "$run/cache"
for _ in 1 2; do cat "$mnt/bench/model@v4"/* "$src"/* >/dev/null; settle "$mnt" >/dev/null; done
$py "$work/mmap_load.py" "$mnt/bench/model@v4" >/dev/null
$py "$work/mmap_load.py" "$src" >/dev/null
for ((r = 1; r <= warm_runs; r++)); do
  t0=$(now); cat "$mnt/bench/model@v4"/* >/dev/null; add W 7 "$(since "$t0")"
  t0=$(now); cat "$src"/* >/dev/null; add B 7 "$(since "$t0")"
  out=$($py "$work/mmap_load.py" "$mnt/bench/model@v4"); read -r t copied <<<"$out"; add W 8 "$t"
  out=$($py "$work/mmap_load.py" "$src"); read -r t copied_local <<<"$out"; add B 8 "$t"
  [[ "$copied" == "$copied_local" ]] || die "row 8 copied $copied bytes through the mount, $copied_local locally"
done
unmount_mnt

# --- The table.
summary() {  # "v1 v2 ..." -> "min / median / max"
  tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{ v[NR] = $1 } END {
    m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
    printf "%.3f / %.3f / %.3f", v[1], m, v[NR] }'
}
median() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{ v[NR] = $1 } END { printf "%.6f", (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
ratio() { awk "BEGIN { printf \"%.2f\", $1 / $2 }"; }
mb() { awk "BEGIN { printf \"%.1f MB\", $1 / 1000000 }"; }
names=(
  [1]="1 save N+1 ($save_files): cp into a draft + commit vs cp + sync"
  [2]="2 weightfs push --parent N vs zstd -3 -T0"
  [3]="3 holding N, read N+1 (cold page cache) vs cold cat"
  [4]="4 N+1 in the disk cache (cold page cache) vs cold cat"
  [5]="5 cold read, empty cache vs cold cat"
  [6]="6 weightfs patch N -> N+1, N cached vs numpy idx/val"
  [7]="7 warm re-read through the mount vs warm cat"
  [8]="8 mmap + copy every tensor, warm vs same on local files"
)
targets=([1]="<= 1.5" [2]="<= 0.6" [3]="<= 1.5" [4]="<= 1.0" [5]="<= 2" [6]="<= 0.5" [7]="<= 1.1" [8]="<= 1.3")
echo
echo "RL step, PARAMS=$params LR=$lr RUNS=$runs WARM_RUNS=$warm_runs: N+1 = $(mb "$size") in $nfiles files, stored as $(mb "$stored_n1") of deltas (chain: FULL + 4 deltas, materializer depth $depth)"
echo "binary $wfs (sha256 ${stamp:0:12}), checkout $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?'), $(nproc) cores, $(uname -r)"
echo
echo "| row: weightfs vs baseline | weightfs s min / med / max | baseline s min / med / max | ratio (median) | target |"
echo "|---|---|---|---|---|"
for i in 1 2 3 4 5 6 7 8; do
  echo "| ${names[$i]} | $(summary "${W[$i]}") | $(summary "${B[$i]}") | $(ratio "$(median "${W[$i]}")" "$(median "${B[$i]}")") | ${targets[$i]} |"
done
echo
echo "row 1: cp into the draft $(summary "${X[1cp]}") s of it, the rest is commit; stored $(mb "$(median "${X[1stored]}")") (push stores $(mb "$(median "${X[2stored]}")"), zstd -3 writes $(mb "$(median "${X[2zstd]}")")); control: dd bs=1M to a local dir + sync $(summary "${X[1dd]}") s"
cpu_s() { awk "BEGIN { printf \"%.2f\", $(median "$1") }"; }
echo "row 1, CPU seconds (median; $(nproc) cores): the machine busy $(cpu_s "${X[1busy]}") during the save into the draft (the daemon's own $(cpu_s "${X[1daemon]}")), $(cpu_s "${X[1busy_local]}") during cp + sync to local disk"
echo "rows 3-5, bucket bytes received (median): 3: $(mb "$(median "${X[3recv]}")"), 4: $(mb "$(median "${X[4recv]}")"), 5: $(mb "$(median "${X[5recv]}")") (N+1's deltas: $(mb "$stored_n1"), the base: $(mb "$stored_v0"))"
echo "rows 3, 5: the local copies of the files read whole (fs/whole_files.h) were written $(summary "${X[3settle]}") s, $(summary "${X[5settle]}") s after the read (waited for before the baseline)"
reporting=no
for d in /sys/bus/virtio/drivers/virtio_balloon/virtio*; do  # feature bit 5: VIRTIO_BALLOON_F_REPORTING
  [[ -r "$d/features" && "$(cut -c6 "$d/features")" == 1 ]] && reporting=yes
done
echo "rows 3-5: cold means the page cache dropped, then ${cold_settle} s (COLD_SETTLE) for both sides; free page reporting to the host: $reporting; fresh memory: 1 GiB of new anonymous memory touched in $(summary "${X[fresh]}") s; the disk alone (dd iflag=direct bs=4M of N+1): $(summary "${X[direct]}") s"
echo "row 6: patch files $(mb "${X[6patch]}"), numpy idx/val files $(mb "${X[6np]}")"
echo "total $(awk "BEGIN { printf \"%.0f\", $(now) - $script_t0 }") s"
