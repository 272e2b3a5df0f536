#!/usr/bin/env bash
# The codec benchmark: install, build, then run `weightfs bench codec` on a
# generated checkpoint sequence (a few minutes on 2 cores, most of it in zstd -19 --patch-from).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
TARGET=weightfs "$root/scripts/build.sh"
"$root/build/tools/weightfs" bench codec --generate --params "${PARAMS:-25M}" \
  --scenarios "${SCENARIOS:-rl-1e-6,rl-3e-6,header-change,sft}"
