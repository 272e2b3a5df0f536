#!/usr/bin/env bash
# Installs, builds (warnings are errors) and runs every test:
#   1. the GoogleTest suites through ctest (Release build);
#   2. the core and hub suites again under AddressSanitizer + UndefinedBehaviorSanitizer;
#   3. every libFuzzer target for FUZZ_SECONDS each (default 20), built with clang.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
jobs=$(nproc)
fuzz_seconds=${FUZZ_SECONDS:-20}
"$root/scripts/setup.sh"

echo "== build (Release, -Werror)"
cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE=Release -DWEIGHTFS_WERROR=ON >/dev/null
cmake --build "$root/build" -j "$jobs"

echo "== build (ASan + UBSan)"
# -O1 -g1: what the sanitizers are meant to run at, and about half the compile time of -O2 -g.
cmake -S "$root" -B "$root/build-asan" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DWEIGHTFS_WERROR=ON \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DWEIGHTFS_SANITIZE=ON >/dev/null
cmake --build "$root/build-asan" -j "$jobs" --target core_tests hub_tests

echo "== build (libFuzzer targets, clang)"
cmake -S "$root" -B "$root/build-fuzz" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DWEIGHTFS_WERROR=ON \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DWEIGHTFS_FUZZ=ON -DWEIGHTFS_TESTS=ON \
  >/dev/null
fuzz_targets=$(cd "$root/tests/fuzz" && ls *_fuzz.cc 2>/dev/null | sed 's/\.cc$//')
for t in $fuzz_targets; do cmake --build "$root/build-fuzz" -j "$jobs" --target "$t"; done

echo "== core and hub tests under ASan + UBSan"
for suite in core_tests hub_tests; do
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 "$root/build-asan/tests/$suite" \
    --gtest_brief=1
done

echo "== fuzzing (${fuzz_seconds}s per target)"
for t in $fuzz_targets; do
  corpus="$root/build-fuzz/corpus-$t"
  mkdir -p "$corpus"
  "$root/build-fuzz/tests/$t" -max_total_time="$fuzz_seconds" -print_final_stats=0 \
    -rss_limit_mb=2048 -timeout=10 "$corpus" 2>&1 | tail -n 2
done

echo "== tests (Release)"
cd "$root/build"
# No retries: a test that fails once is a bug report (a race in the product or in the test).
ctest --output-on-failure -j "$jobs"
