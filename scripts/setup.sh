#!/usr/bin/env bash
# Installs the Debian packages weightfs needs to build, test and benchmark. Idempotent: when
# everything is present it does nothing (and needs no network).
set -euo pipefail

PACKAGES=(
  build-essential cmake pkg-config clang libclang-rt-14-dev   # toolchain; clang for libFuzzer
  libfuse3-dev fuse3                                         # the mount
  libzstd-dev zstd                                           # codecs; the zstd CLI is a benchmark baseline
  libcurl4-openssl-dev libssl-dev                            # buckets over HTTP/S3; SHA-256
  nlohmann-json3-dev libspdlog-dev libxxhash-dev libgtest-dev
  python3 python3-numpy                                      # test readers
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  exit 0
fi
echo "weightfs setup: installing ${missing[*]}" >&2
SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
