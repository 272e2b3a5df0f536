#!/usr/bin/env bash
# RL weight sync end to end (issue 15): a trainer node publishes step N+1 into the bucket by
# writing it into a draft of its mount and committing; an inference node that holds step N
# waits for it (`weightfs wait` on its own mount, its own cache) and then takes N+1 either
#   (a) whole, reading every file of N+1 through its mount (what a restart of the engine reads),
#   (b) as sparse patches N -> N+1 (`weightfs patch`, from its cache of N plus the deltas),
# against TRL's delta sync on the same pair:
#   (c) the trainer uploads the idx/val patch files, the inference node downloads them
#       (the same files: weightfs's patch format is TRL's / vLLM's).
# Bytes are what crosses the network (bucket bytes received; for (c) the patch files, both
# ways); seconds are from the commit's start.
#
# Environment: PARAMS (1B), LR (1e-6: ~1.2% of elements change per step), WORK
# (/tmp/wfs-bench-rl), KEEP=1 keeps WORK, WEIGHTFS=path uses a prebuilt binary. Needs FUSE.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
params=${PARAMS:-1B}
lr=${LR:-1e-6}
work=${WORK:-/tmp/wfs-bench-rl}

"$root/scripts/setup.sh"
if [[ -n "${WEIGHTFS:-}" ]]; then
  wfs=$WEIGHTFS
else
  TARGET=weightfs "$root/scripts/build.sh" >/dev/null
  wfs="$root/build/tools/weightfs"
fi

now() { date +%s.%N; }
secs() { awk "BEGIN { printf \"%.2f\", $2 - $1 }"; }
mb() { awk "BEGIN { printf \"%.1f MB\", $1 / 1000000 }"; }
ratio() { awk "BEGIN { printf \"%.2f\", $1 / $2 }"; }
received() { /usr/bin/python3 -c "import json,os,sys; print(json.loads(os.getxattr(sys.argv[1], 'user.weightfs.stats'))['bucket']['bytes_received'])" "$1"; }

mkdir -p "$work"
data="$work/data-$params-$lr"
if [[ ! -f "$data/versions.json" ]]; then
  rm -rf "$work"/data-*
  echo "== generating $params params x 2 versions (lr $lr)"
  "$wfs" gen "$data" --params "$params" --versions 1 --lr "$lr" --shard-size 500M --seed 5
fi
bucket="$work/bucket"
trainer="$work/trainer" infer="$work/infer"
mounted() { awk -v m="$1" '$5 == m { found = 1 } END { exit !found }' /proc/self/mountinfo; }
cleanup() {
  for m in "$trainer/mnt" "$infer/mnt"; do
    if mounted "$m"; then "$wfs" unmount --keep-drafts "$m" >/dev/null 2>&1 || umount -l "$m" || true; fi
  done
  [[ "${KEEP:-0}" == 1 ]] || rm -rf "$work"/bucket "$work"/trainer "$work"/infer "$work"/patches "$work"/trl
}
trap cleanup EXIT
cleanup
mkdir -p "$trainer/mnt" "$infer/mnt" "$work/patches" "$work/trl/bucket" "$work/trl/node"
"$wfs" init "$bucket" >/dev/null
"$wfs" push "$bucket" rl/policy@step-0 "$data/v000" --cache-dir "$trainer/cache" >/dev/null
src="$data/v001"
size=$(du -sb "$src" | cut -f1)
echo "== step N+1: $(mb "$size") in $(ls "$src" | wc -l) files"

# The inference node holds step N: it read it through its mount (its cache has every chunk).
"$wfs" mount "$bucket" "$infer/mnt" --cache-dir "$infer/cache" --refresh 3600 --log-file "$infer/mount.log" >/dev/null
cat "$infer/mnt/rl/policy@step-0"/* >/dev/null
"$wfs" mount "$bucket" "$trainer/mnt" --cache-dir "$trainer/cache" --log-file "$trainer/mount.log" >/dev/null

# The inference node waits; the trainer saves N+1 into a draft and commits.
"$wfs" wait "$infer/mnt/rl/policy@step-1" --timeout 600 > "$work/waited" &
waiter=$!
cat "$src"/* >/dev/null  # the trainer's files are in its page cache, as after a save
t0=$(now)
mkdir "$trainer/mnt/rl/policy@step-1"
cp "$src"/* "$trainer/mnt/rl/policy@step-1/"
"$wfs" commit "$trainer/mnt/rl/policy@step-1" >/dev/null
t_commit=$(now)
wait "$waiter"
t_visible=$(now)
stored=$("$wfs" log "$bucket" rl/policy --json | /usr/bin/python3 -c "import json,sys; print(json.load(sys.stdin)[-1]['stored_bytes'])")

# (a) the whole of N+1 through the mount.
before=$(received "$infer/mnt")
t_a0=$(now)
(cd "$src" && sha256sum -- *) > "$work/expect.sha256"
(cd "$infer/mnt/rl/policy@step-1" && sha256sum --quiet -c "$work/expect.sha256")
t_a1=$(now)
whole_received=$(( $(received "$infer/mnt") - before ))

# (b) patches N -> N+1 from the inference node's cache (of N, and of N+1 after (a): the deltas
# still come from the bucket, they are not cached).
t_b0=$(now)
"$wfs" patch "$bucket" rl/policy@step-1 --from step-0 -o "$work/patches" --cache-dir "$infer/cache" --stats > "$work/patch.out" 2>&1
t_b1=$(now)
patch_bytes=$(du -sb "$work/patches" | cut -f1)
patch_total=$(grep "^total:" "$work/patch.out")
patch_fetched=$(sed -E 's/.*; fetched ([^;]*) in [0-9]+ requests, fetched\/stored ([^;]*);.*/\1 = \2 the stored delta/' <<< "$patch_total")

# (c) TRL's way on the same pair: the trainer uploads the idx/val files (here: copies them into
# a directory bucket), the inference node downloads them. Computing them is free for TRL's
# trainer (it diffs tensors it holds in memory), so only the transfer is timed.
t_c0=$(now)
cp "$work/patches"/* "$work/trl/bucket/"; sync -f "$work/trl/bucket"
cp "$work/trl/bucket"/* "$work/trl/node/"
t_c1=$(now)

echo
echo "commit (cp into a draft + commit)            $(secs "$t0" "$t_commit") s; stored $(mb "$stored") ($(ratio "$size" "$stored")x smaller than N+1)"
echo "published -> visible on the inference node   $(secs "$t_commit" "$t_visible") s (weightfs wait)"
echo "(a) N+1 whole through the mount               $(secs "$t_a0" "$t_a1") s, received $(mb "$whole_received") = $(ratio "$whole_received" "$stored")x the stored delta"
echo "(b) patches N -> N+1 (weightfs patch)         $(secs "$t_b0" "$t_b1") s, received $patch_fetched; patch files $(mb "$patch_bytes")"
echo "(c) TRL: upload + download the idx/val files  $(secs "$t_c0" "$t_c1") s (local copies), $(mb $((2 * patch_bytes))) on the wire = $(ratio $((2 * patch_bytes)) "$stored")x the stored delta"
echo "    weightfs patch: $patch_total"
