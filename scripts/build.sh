#!/usr/bin/env bash
# Configures and builds weightfs into BUILD_DIR (default: build/): every target, or only
# TARGET when set. Extra arguments go to cmake.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
# Unity build: a clean build in half the time (CMakeLists.txt, WEIGHTFS_PCH).
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_UNITY_BUILD=ON "$@" >/dev/null
cmake --build "$build" -j "$(nproc)" ${TARGET:+--target "$TARGET"}
