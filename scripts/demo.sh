#!/usr/bin/env bash
# The main job on the embedded default: install, build, then run the codec benchmark on a
# generated checkpoint sequence (a few minutes on 2 cores). Later: a mount demo.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
TARGET=weightfs "$root/scripts/build.sh"
"$root/build/tools/weightfs" bench codec --generate --params "${PARAMS:-25M}" \
  --scenarios "${SCENARIOS:-rl-1e-6,rl-3e-6,header-change,sft}"
