#!/usr/bin/env bash
# Many nodes, one version (docs/parts.md): 1, 2 and 4 writer mounts on this machine save the
# same 8-shard checkpoint N+1 into drafts of one version, each its own share of the shards, and
# run `weightfs commit --parts W`. Each writer holds N in its own cache directory (as a training
# node that saved N does). Measured per W:
#   - seconds from the last close (every writer's cp done) to the version readable on another
#     mount (`weightfs wait` on a reader mount), and to every commit returned;
#   - the bucket requests of all the writers' commits (their mounts' counters, from the first
#     commit to the last return), and of the final publish alone (the publishing node's share);
#   - the baseline of the same run: one mount, all 8 shards, a plain `weightfs commit`;
#   - a check that the reader gets every file bit-exact (sha256sum).
#
# Environment: PARAMS (200M: ~400 MB of bf16), WORK (/tmp/wfs-bench-parts), KEEP=1 keeps WORK,
# WEIGHTFS=path uses a prebuilt binary. Needs root or FUSE access.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
params=${PARAMS:-200M}
work=${WORK:-/tmp/wfs-bench-parts}

"$root/scripts/setup.sh"
if [[ -n "${WEIGHTFS:-}" ]]; then
  wfs=$WEIGHTFS
else
  TARGET=weightfs "$root/scripts/build.sh" >/dev/null
  wfs="$root/build/tools/weightfs"
fi

now() { date +%s.%N; }
secs() { awk "BEGIN { printf \"%.2f\", $2 - $1 }"; }
requests() { getfattr -n user.weightfs.stats --only-values "$1" 2>/dev/null |
  /usr/bin/python3 -c "import json,sys; print(json.load(sys.stdin)['bucket']['requests'])"; }
mounted() { awk -v m="$1" '$5 == m { found = 1 } END { exit !found }' /proc/self/mountinfo; }
mounts=()
cleanup() {
  for m in "${mounts[@]}"; do
    if mounted "$m"; then "$wfs" unmount --keep-drafts "$m" >/dev/null 2>&1 || umount -l "$m" || true; fi
  done
  [[ "${KEEP:-0}" == 1 ]] || rm -rf "$work"
}
trap cleanup EXIT

mkdir -p "$work"
data="$work/data-$params"
if [[ ! -f "$data/versions.json" ]]; then
  rm -rf "$work"/data-*
  echo "== generating $params params x 2 versions (lr 1e-6), 8 shards"
  # Shard size: an eighth of the bf16 bytes (the model is within ~10% of PARAMS), so that
  # save_pretrained-like sharding makes 8 files.
  bytes=$(/usr/bin/python3 -c "import sys; s=sys.argv[1]; m={'K':1e3,'M':1e6,'B':1e9,'G':1e9,'T':1e12}; print(int(float(s[:-1]) * m[s[-1]] * 2 if s[-1] in m else float(s) * 2))" "$params")
  "$wfs" gen "$data" --params "$params" --versions 1 --lr 1e-6 --shard-size "$((bytes / 8))" --seed 5 >/dev/null
fi
src="$data/v001"
shards=("$src"/model-*.safetensors)
others=()
for f in "$src"/*; do [[ "$f" == *model-*.safetensors ]] || others+=("$f"); done
size=$(du -sb "$src" | cut -f1)
echo "== version N+1: $((size / 1000000)) MB in ${#shards[@]} shards (+${#others[@]} small files)"
(cd "$src" && sha256sum -- *) > "$work/expect.sha256"

# One run: W writers (W=0: the one-node baseline, a plain commit of everything from one mount).
run() {
  local w=$1 n=$(( $1 == 0 ? 1 : $1 ))
  local bucket="$work/bucket-$w"
  rm -rf "$bucket" "$work"/cache-* "$work"/mnt-*
  mounts=()
  "$wfs" init "$bucket" >/dev/null
  "$wfs" push "$bucket" bench/model@v0 "$data/v000" --cache-dir "$work/cache-push" >/dev/null
  for ((k = 0; k < n; k++)); do
    # Writer k holds N (its chunk cache has v0), as the node that saved N does.
    "$wfs" pull "$bucket" bench/model@v0 "$work/held-$k" --cache-dir "$work/cache-$k" >/dev/null
    rm -rf "$work/held-$k"
    mkdir -p "$work/mnt-$k"
    "$wfs" mount "$bucket" "$work/mnt-$k" --cache-dir "$work/cache-$k" --log-file "$work/mount-$w-$k.log" >/dev/null
    mounts+=("$work/mnt-$k")
  done
  mkdir -p "$work/mnt-reader"
  "$wfs" mount "$bucket" "$work/mnt-reader" --cache-dir "$work/cache-reader" --log-file "$work/mount-$w-reader.log" >/dev/null
  mounts+=("$work/mnt-reader")
  cat "$src"/* >/dev/null  # every run copies from the page cache
  for ((k = 0; k < n; k++)); do mkdir "$work/mnt-$k/bench/model@v1"; done
  # Writer k copies shards k, k+n, ...; writer 0 also the small files (config, index).
  local pids=()
  for ((k = 0; k < n; k++)); do
    (
      for ((i = k; i < ${#shards[@]}; i += n)); do cp "${shards[$i]}" "$work/mnt-$k/bench/model@v1/"; done
      if ((k == 0)); then cp "${others[@]}" "$work/mnt-0/bench/model@v1/"; fi
    ) &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  local t_close before=() r0
  t_close=$(now)
  for ((k = 0; k < n; k++)); do before+=("$(requests "$work/mnt-$k")"); done
  pids=()
  for ((k = 0; k < n; k++)); do
    if ((w == 0)); then
      "$wfs" commit "$work/mnt-$k/bench/model@v1" >"$work/commit-$w-$k.out" 2>&1 &
    else
      "$wfs" commit "$work/mnt-$k/bench/model@v1" --parts "$n" --part "rank$k" >"$work/commit-$w-$k.out" 2>&1 &
    fi
    pids+=($!)
  done
  "$wfs" wait "$work/mnt-reader/bench/model@v1" --timeout 600 --interval 0.05 >/dev/null
  local t_readable t_done
  t_readable=$(now)
  for p in "${pids[@]}"; do wait "$p" || { cat "$work"/commit-"$w"-*.out; exit 1; }; done
  t_done=$(now)
  local total=0 most=0 d
  for ((k = 0; k < n; k++)); do
    d=$(( $(requests "$work/mnt-$k") - ${before[$k]} ))
    total=$((total + d))
    ((d > most)) && most=$d
  done
  (cd "$work/mnt-reader/bench/model@v1" && sha256sum --quiet -c "$work/expect.sha256")
  local stored
  stored=$("$wfs" log "$bucket" bench/model --json | /usr/bin/python3 -c \
    "import json,sys; print([v for v in json.load(sys.stdin) if v.get('version') == 'v1'][0]['stored_bytes'])")
  printf "%-22s %8s s %8s s %10s %14s %12s\n" "$([[ $w == 0 ]] && echo "1 mount, plain commit" || echo "$w writer(s), --parts $w")" \
    "$(secs "$t_close" "$t_readable")" "$(secs "$t_close" "$t_done")" "$total" "$most" "$stored"
  for m in "${mounts[@]}"; do "$wfs" unmount --keep-drafts "$m" >/dev/null 2>&1 || umount -l "$m"; done
  mounts=()
}

echo
printf "%-22s %10s %10s %10s %14s %12s\n" "writers" "readable" "all done" "requests" "most one node" "stored B"
run 0
for w in 1 2 4; do run "$w"; done
echo
echo "readable: last close -> the version visible and read bit-exact on another mount (weightfs wait)"
echo "requests: bucket requests of every writer's commit (lost-pack checks, part records, polling, the publish)"
