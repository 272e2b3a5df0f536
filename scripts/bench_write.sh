#!/usr/bin/env bash
# Write-path benchmark (issue 5): a trainer saving checkpoint N+1 into a draft on the mount of
# a node that holds N, against the same job done without the mount.
#
#   (a) cp of version N+1's files to local disk (the reference) vs cp into a draft
#   (b) time from the last close to published (`weightfs commit`) vs `weightfs push` of the
#       same files with the same parent (each from the same warm state: N in the chunk cache)
#   (c) stored bytes of the committed draft vs `weightfs push`
#
# Environment: PARAMS (1B: ~2 GB of bf16), WORK (/tmp/wfs-bench-write), KEEP=1 keeps WORK,
# WEIGHTFS=path uses a prebuilt binary. Needs root or FUSE access.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
params=${PARAMS:-1B}
work=${WORK:-/tmp/wfs-bench-write}

"$root/scripts/setup.sh"
if [[ -n "${WEIGHTFS:-}" ]]; then
  wfs=$WEIGHTFS
else
  TARGET=weightfs "$root/scripts/build.sh" >/dev/null
  wfs="$root/build/tools/weightfs"
fi

now() { date +%s.%N; }
secs() { awk "BEGIN { printf \"%.2f\", $2 - $1 }"; }
mbps() { awk "BEGIN { printf \"%.0f\", $1 / 1000000 / $2 }"; }
ratio() { awk "BEGIN { printf \"%.2f\", $1 / $2 }"; }
stored() { "$wfs" log "$bucket" --json | /usr/bin/python3 -c "import json,sys; print([v for v in json.load(sys.stdin) if v['model'] + '@' + v['version'] == sys.argv[1]][0]['stored_bytes'])" "$1"; }

mkdir -p "$work"
data="$work/data-$params"
if [[ ! -f "$data/versions.json" ]]; then
  rm -rf "$work"/data-*
  echo "== generating $params params x 2 versions (lr 1e-6)"
  "$wfs" gen "$data" --params "$params" --versions 1 --lr 1e-6 --shard-size 500M --seed 5
fi
bucket="$work/bucket"
mnt="$work/mnt"
mounted() { awk -v m="$mnt" '$5 == m { found = 1 } END { exit !found }' /proc/self/mountinfo; }
cleanup() {
  if mounted; then "$wfs" unmount --keep-drafts "$mnt" >/dev/null 2>&1 || umount -l "$mnt" || true; fi
  [[ "${KEEP:-0}" == 1 ]] || rm -rf "$work"
}
trap cleanup EXIT
rm -rf "$bucket" "$work"/cache-* "$work/local" "$mnt"
mkdir -p "$mnt"
"$wfs" init "$bucket" >/dev/null
# The node holds N: pushing it records N's chunks in each cache directory used below.
"$wfs" push "$bucket" bench/model@v0 "$data/v000" --cache-dir "$work/cache-push" >/dev/null
"$wfs" pull "$bucket" bench/model@v0 "$work/v0-copy" --cache-dir "$work/cache-mount" >/dev/null
src="$data/v001"
size=$(du -sb "$src" | cut -f1)
echo "== version N+1: $((size / 1000000)) MB in $(ls "$src" | wc -l) files"
cat "$src"/* >/dev/null  # warm: every run reads from the page cache

# (a) cp to local disk, then into a draft.
t0=$(now); mkdir "$work/local"; cp "$src"/* "$work/local/"; sync -f "$work/local"; t1=$(now)
a_local=$(secs "$t0" "$t1")
"$wfs" mount "$bucket" "$mnt" --cache-dir "$work/cache-mount" --log-file "$work/mount.log" >/dev/null
t0=$(now); mkdir "$mnt/bench/model@v1"; cp "$src"/* "$mnt/bench/model@v1/"; t1=$(now)
a_draft=$(secs "$t0" "$t1")

# (b) from the last close to published, vs push.
t0=$(now); "$wfs" commit "$mnt/bench/model@v1" >/dev/null; t1=$(now)
b_commit=$(secs "$t0" "$t1")
t0=$(now); "$wfs" push "$bucket" bench/model@v1push "$src" --parent v0 --cache-dir "$work/cache-push" >/dev/null; t1=$(now)
b_push=$(secs "$t0" "$t1")
# What the whole save costs with the mount (cp + commit) vs cp to disk + push.
total_mount=$(awk "BEGIN { print $a_draft + $b_commit }")
total_push=$(awk "BEGIN { print $a_local + $b_push }")

# (c) stored bytes, and a check that the committed version reads back bit-exact.
s_commit=$(stored bench/model@v1)
s_push=$(stored bench/model@v1push)
(cd "$src" && sha256sum -- *) > "$work/expect.sha256"
(cd "$mnt/bench/model@v1" && sha256sum --quiet -c "$work/expect.sha256")

echo
echo "(a) cp to local disk          $a_local s  $(mbps "$size" "$a_local") MB/s"
echo "    cp into a draft           $a_draft s  $(mbps "$size" "$a_draft") MB/s   ratio $(ratio "$a_local" "$a_draft")x of local"
echo "(b) last close -> published   $b_commit s"
echo "    weightfs push             $b_push s   commit takes $(ratio "$b_commit" "$b_push")x of push"
echo "    cp + commit               $total_mount s vs cp to disk + push $total_push s ($(ratio "$total_push" "$total_mount")x)"
echo "(c) stored: commit $s_commit B, push $s_push B (ratio $(ratio "$s_commit" "$s_push")); $(ratio "$size" "$s_commit")x smaller than the files"
