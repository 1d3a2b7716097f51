#!/usr/bin/env bash
# The whole test suite, as CI runs it (.ci/run calls this): installs what is
# missing, builds the normal and the ASan+UBSan binaries, and runs through ctest
# the unit and world tiers (C unit tests, busted specs in the busted process and
# over real rpchost processes, the style, install and fuzz checks) on both, then
# on the normal build the slurm tier (worlds under a Slurm cluster the spec
# starts, one node and two in network namespaces: skipped, saying why, where
# munged, slurmctld or slurmd cannot start), the docs tier (every page checked
# against the program: runnable blocks, quoted errors, variables, flags,
# options) and the soak tier (chaos, load, long and big runs).
#   scripts/test.sh          the whole suite
#   scripts/test.sh --docs   the normal build and its docs tier alone
#   scripts/test.sh --soak   the normal build and its soak tier alone
# (one tier of a build: ctest --test-dir build -L unit, -L world, -L slurm, -L docs or -L soak)
set -euo pipefail
cd "$(dirname "$0")/.."
only=""
case "${1:-}" in
  "") ;;
  --soak) only=soak ;;
  --docs) only=docs ;;
  *) echo "usage: bash scripts/test.sh [--docs | --soak]" >&2; exit 2 ;;
esac
bash scripts/setup.sh
jobs=$(nproc 2>/dev/null || echo 2)
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$jobs"
if [ -n "$only" ]; then
  exec ctest --test-dir build -L "$only" --output-on-failure
fi
# the unit, world and docs tiers
ctest --test-dir build -LE soak --output-on-failure
# (the CUDA kernels library is built and installed once, above: not again here)
cmake -S . -B build-asan -DRPCHOST_SANITIZE=ON -DRPCHOST_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug >/dev/null
cmake --build build-asan -j"$jobs"
ctest --test-dir build-asan -LE 'soak|slurm|docs' --output-on-failure
# the soak tier, on the normal build only
ctest --test-dir build -L soak --output-on-failure
