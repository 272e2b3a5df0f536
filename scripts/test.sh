#!/usr/bin/env bash
# Installs, builds (warnings are errors) and runs every test, in about 21 minutes on 2 cores
# (1285 s on a fresh clone with the packages installed: Release build 343 s, clang build 353 s,
# sanitizer suites with the fuzzers 197 s, ctest 391 s; before unity builds and Ninja, 1674 s):
#   1. the GoogleTest suites through ctest (Release build, gcc);
#   2. the core and hub suites (store, engine, hf/trl), the in-process read path (reader_tests) and
#      the in-process drafts (drafts_tests) again under AddressSanitizer + UndefinedBehaviorSanitizer, and
#   3. beside them, every libFuzzer target for FUZZ_SECONDS each (default 15): both from one
#      clang build (-O1, assertions on), so the libraries are compiled twice in all.
# Each phase prints its wall time. JOBS sets the build's parallelism (default: the number of
# cores); ctest runs twice as many tests at once.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
jobs=${JOBS:-$(nproc)}
fuzz_seconds=${FUZZ_SECONDS:-15}
start=$SECONDS
phase_start=$SECONDS
phase() {
  if ((SECONDS > start)); then echo "   (took $((SECONDS - phase_start)) s)"; fi
  phase_start=$SECONDS
  echo "== $* [at $((SECONDS - start)) s]"
}

phase "setup (Debian packages, s3rver)"
"$root/scripts/setup.sh"

# Both builds are unity builds (CMakeLists.txt, WEIGHTFS_PCH: half the time of a build file by
# file) with Ninja where a build directory is new (an existing one keeps its generator).
configure() {
  local dir=$1
  shift
  local generator=()
  if [[ ! -f "$dir/CMakeCache.txt" ]] && command -v ninja >/dev/null; then generator=(-G Ninja); fi
  cmake "${generator[@]}" -S "$root" -B "$dir" -DCMAKE_UNITY_BUILD=ON "$@" >/dev/null
}

phase "build (Release, gcc, -Werror)"
configure "$root/build" -DCMAKE_BUILD_TYPE=Release -DWEIGHTFS_WERROR=ON
cmake --build "$root/build" -j "$jobs"

phase "build (clang: ASan + UBSan + libFuzzer; the core, hub, reader and drafts suites and the fuzz targets)"
# Debug: assertions on; the sanitizer options in CMakeLists.txt set -O1 -g1.
configure "$root/build-san" -DCMAKE_BUILD_TYPE=Debug -DWEIGHTFS_WERROR=ON \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DWEIGHTFS_FUZZ=ON
san_suites="core_tests store_tests engine_tests hub_tests reader_tests drafts_tests"
fuzz_targets=$(cd "$root/tests/fuzz" && ls *_fuzz.cc 2>/dev/null | sed 's/\.cc$//')
# weightfs_fs too: not run here, but compiled by clang for -Wthread-safety (fs/drafts/'s locks).
# shellcheck disable=SC2086
cmake --build "$root/build-san" -j "$jobs" --target $san_suites $fuzz_targets weightfs_fs

phase "core, hub (store, engine, hf, trl), the read path and the drafts in process under ASan + UBSan; beside them, every fuzz target for ${fuzz_seconds} s"
# The fuzzers run one after another in the background (one core) while the suites run: most of
# the suites' time is one thread too.
fuzz_log="$root/build-san/fuzz.log"
(
  for t in $fuzz_targets; do
    corpus="$root/build-san/corpus-$t"
    mkdir -p "$corpus"
    echo "-- $t"
    "$root/build-san/tests/$t" -max_total_time="$fuzz_seconds" -print_final_stats=0 \
      -rss_limit_mb=2048 -timeout=10 "$corpus" 2>&1 | tail -n 2
  done
) >"$fuzz_log" 2>&1 &
fuzz_pid=$!
trap 'kill "$fuzz_pid" 2>/dev/null || true' EXIT
# shellcheck disable=SC2086
for suite in $san_suites; do
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 "$root/build-san/tests/$suite" \
    --gtest_brief=1
done
if ! wait "$fuzz_pid"; then
  cat "$fuzz_log"
  echo "a fuzz target failed (its output is above; the crashing input is in the current directory)" >&2
  exit 1
fi
trap - EXIT
cat "$fuzz_log"

phase "tests (Release)"
cd "$root/build"
# No retries: a test that fails once is a bug report (a race in the product or in the test).
# Twice the cores: many integration tests mostly wait (for servers, timeouts, a killed daemon).
ctest --output-on-failure -j "$((jobs * 2))"
phase "all passed in $((SECONDS - start)) s"
