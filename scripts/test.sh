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
# (the CUDA kernels library is built and installed once, above: not again here)
cmake -S . -B build-asan -DRPCHOST_SANITIZE=ON -DRPCHOST_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug >/dev/null
cmake --build build-asan -j"$jobs"
ctest --test-dir build-asan --output-on-failure
