#!/usr/bin/env bash
# The whole test suite, as CI runs it (.ci/run calls this): installs what is
# missing, builds the normal and the ASan+UBSan binaries, and runs every test
# (C unit tests and busted specs over real rpchost processes) through ctest on both.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$jobs"
ctest --test-dir build --output-on-failure
cmake -S . -B build-asan -DRPCHOST_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug >/dev/null
cmake --build build-asan -j"$jobs"
ctest --test-dir build-asan --output-on-failure
