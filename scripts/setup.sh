#!/usr/bin/env bash
# Installs the Debian packages weightfs needs to build, test and benchmark. Idempotent: when
# everything is present it does nothing (and needs no network).
set -euo pipefail

PACKAGES=(
  build-essential cmake pkg-config clang libclang-rt-14-dev   # toolchain; clang for libFuzzer
  ninja-build                                                # schedules the 2 cores better than make
  libfuse3-dev fuse3                                         # the mount
  libzstd-dev zstd                                           # codecs; the zstd CLI is a benchmark baseline
  libcurl4-openssl-dev libssl-dev                            # buckets over HTTP/S3; SHA-256
  nlohmann-json3-dev libspdlog-dev libxxhash-dev libgtest-dev
  python3 python3-numpy                                      # test readers
  attr                                                       # setfattr/getfattr on drafts (docs/drafts.md)
  nginx-extras                                               # WebDAV server for the http:// store tests
  nodejs                                                     # runs s3rver (npm comes with the machine's Node.js)
  systemd util-linux                                         # systemd-analyze/systemd-escape, unshare: the install tests
)
S3RVER_VERSION=3.7.1

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
install_s3rver() {
  if ! command -v s3rver >/dev/null 2>&1; then
    echo "weightfs setup: installing s3rver@$S3RVER_VERSION from npm" >&2
    $SUDO npm install -g --silent --no-audit --no-fund "s3rver@$S3RVER_VERSION" >/dev/null
  fi
}
if ((${#missing[@]} == 0)); then
  install_s3rver
  exit 0
fi
echo "weightfs setup: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
install_s3rver
