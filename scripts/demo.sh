#!/usr/bin/env bash
# The main job on the embedded default, in about a minute: builds weightfs, generates a small
# sharded bf16 model with a few training versions, pushes them to a local bucket, mounts it,
# lists the versions and reads the latest one through the mount, checking every file's SHA-256
# against the source, then saves one more step through the mount as a draft (mkdir + cp +
# weightfs commit). Leaves the mount up for you to explore and says how to unmount it.
# Environment: PARAMS (25M), VERSIONS (3 after the base), WORK (a new private directory under
# /tmp; a WORK of your own must be empty or a previous demo's, which is cleaned).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
params=${PARAMS:-25M}
versions=${VERSIONS:-3}
if [[ -n "${WORK:-}" ]]; then
  work=$WORK
  if [[ -d "$work" && -n "$(ls -A "$work" 2>/dev/null)" && ! -f "$work/.weightfs-demo" ]]; then
    echo "weightfs demo: WORK=$work holds files that are not a previous demo's; give an empty or new directory" >&2
    exit 1
  fi
else
  work=$(mktemp -d /tmp/weightfs-demo.XXXXXX)
fi
"$root/scripts/setup.sh"
echo "== building weightfs (Release; the first build takes about 2.5 minutes on 2 cores, then seconds)"
build_log="$work.build.log"
echo "   full compiler output: $build_log"
# The build's own [ NN%] lines, condensed to one line per 10%, so a first build is not silent.
# (A bash loop reads line by line; mawk, Debian's awk, reads a pipe in blocks and printed
# nothing for minutes, then everything at once.)
progress() {
  local next=0 line p
  while IFS= read -r line; do
    if [[ $line =~ ^\[\ *([0-9]+)%\] ]]; then
      p=${BASH_REMATCH[1]}
      if ((p >= next)); then
        echo "   $line"
        next=$((p - p % 10 + 10))
      fi
    fi
  done
}
if ! TARGET=weightfs "$root/scripts/build.sh" 2>&1 | tee "$build_log" | progress; then
  echo "weightfs demo: the build failed; see $build_log" >&2
  exit 1
fi
wfs="$root/build/tools/weightfs"

mnt="$work/mnt"
if awk -v m="$mnt" '$5 == m { found = 1 } END { exit !found }' /proc/self/mountinfo; then
  "$wfs" unmount "$mnt" >/dev/null || "$wfs" unmount --lazy "$mnt" >/dev/null
fi
rm -rf "$work"
mkdir -p "$work" "$mnt"
touch "$work/.weightfs-demo"
echo "== generating a $params-parameter model and $versions training steps (lr 1e-6)"
"$wfs" gen "$work/src" --params "$params" --versions "$((versions + 1))" --lr 1e-6 --shard-size 20M --seed 7
"$wfs" init "$work/bucket"
for ((k = 0; k <= versions; k++)); do
  "$wfs" push "$work/bucket" "demo/llama@step-$k" "$work/src/$(printf v%03d $k)" --cache-dir "$work/push-cache"
done
echo
echo "== weightfs mount $work/bucket $mnt"
"$wfs" mount "$work/bucket" "$mnt" --cache-dir "$work/cache"
echo
echo "\$ ls -l $mnt/demo"
ls -l "$mnt/demo"
latest="$mnt/demo/llama@latest"
echo
echo "\$ sha256sum $latest/*   (materialized through the mount, compared with the source)"
( cd "$work/src/$(printf v%03d "$versions")" && sha256sum * ) >"$work/expected.sha256"
( cd "$latest" && sha256sum -c "$work/expected.sha256" )
echo
echo "\$ getfattr-like view of $latest (user.weightfs.*):"
/usr/bin/python3 - "$latest" <<'PY'
import os, sys
d = os.path.realpath(sys.argv[1])
for name in os.listxattr(d):
    print(f"  {name} = {os.getxattr(d, name).decode()}")
PY
next=$((versions + 1))
draft="$mnt/demo/llama@step-$next"
echo
echo "== saving step $next through the mount: a draft, encoded and uploaded as each file closes"
echo "\$ mkdir $draft && cp $work/src/$(printf v%03d $next)/* $draft/"
mkdir "$draft"
cp "$work/src/$(printf v%03d $next)"/* "$draft/"
echo "\$ weightfs commit $draft"
"$wfs" commit "$draft"
( cd "$work/src/$(printf v%03d $next)" && sha256sum * ) >"$work/expected-next.sha256"
( cd "$draft" && sha256sum --quiet -c "$work/expected-next.sha256" ) && echo "  every file of step-$next reads back bit-exact"
echo
echo "\$ weightfs log $work/bucket"
"$wfs" log "$work/bucket"
echo
echo "The mount stays up: explore $mnt, then unmount with:"
echo "  $wfs unmount $mnt"
