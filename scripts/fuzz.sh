#!/usr/bin/env bash
# Builds the libFuzzer harnesses (tests/fuzz: the frame reader, the MessagePack
# bounds check, the codec's decoder into Lua values and the tensor shapes) with
# clang and runs each one for the given number of seconds (default 10) from its
# seed corpus (tests/fuzz/corpus):
#   bash scripts/fuzz.sh [seconds]
# Exits 77 (ctest's skip) when clang with libFuzzer is not installed.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-10}
CC=${FUZZ_CC:-clang}
if ! command -v "$CC" >/dev/null 2>&1; then echo "fuzz: $CC not found, skipping"; exit 77; fi
out=build-fuzz
mkdir -p "$out"
flags="-g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -Ihost"
if ! echo 'int LLVMFuzzerTestOneInput(const char*d,unsigned long n){return 0;}' |
     "$CC" $flags -x c - -o "$out/probe" 2>/dev/null; then
  echo "fuzz: $CC cannot build libFuzzer targets (install libclang-rt-dev), skipping"; exit 77
fi
"$CC" $flags tests/fuzz/fuzz_frame.c host/net/frame.c host/errors.c $(pkg-config --cflags --libs libuv) -o "$out/fuzz_frame"
"$CC" $flags tests/fuzz/fuzz_msgpack.c host/codec/mpcheck.c $(pkg-config --cflags --libs msgpack) -o "$out/fuzz_msgpack"
"$CC" $flags -Ibindings tests/fuzz/fuzz_codec.c bindings/l_codec.c bindings/l_body.c bindings/rh_lua.c bindings/l_tensor.c \
  bindings/l_generator.c host/codec/mpcheck.c host/errors.c host/tensor/*.c \
  $(pkg-config --cflags --libs luajit msgpack libuv openblas) -lm -ldl -lpthread -o "$out/fuzz_codec"
"$CC" $flags tests/fuzz/fuzz_shape.c host/tensor/*.c \
  $(pkg-config --cflags --libs openblas libuv) -lm -ldl -lpthread -o "$out/fuzz_shape"
for t in frame msgpack codec shape; do
  mkdir -p "$out/corpus_$t"
  seeds=tests/fuzz/corpus/$t
  [ "$t" = codec ] && seeds=tests/fuzz/corpus/msgpack # (the same bytes: MessagePack messages)
  echo "fuzz: $t for ${secs}s"
  "$out/fuzz_$t" -max_total_time="$secs" -max_len=4096 -rss_limit_mb=1024 -print_final_stats=1 \
    "$out/corpus_$t" "$seeds" 2>&1 | grep -E "Done|stat::number_of_executed_units|ERROR|SUMMARY" || true
  # a crash, leak, OOM or timeout leaves its input in a file named so (the status
  # is lost in the pipe above); any one of them is a failure
  for f in crash-* leak-* oom-* timeout-*; do
    if [ -e "$f" ]; then echo "fuzz: $t found a failure ($f)"; exit 1; fi
  done
done
echo "fuzz: no crash"
