#!/usr/bin/env bash
# The suite's style.c_layers test: the C half depends one way
# (docs/architecture.md, "The C half"). Reads the symbols of the host library
# (librhhost.a, given as $1) and fails on
#   - a call from one floor of the tensor core up to a higher one, or between
#     the files of one of its lower floors (the floors host/tensor/tensor.h
#     lists; the files above ops.c, and those of nn/, may call their neighbours);
#   - a call from host/ into bindings/ (rh_lua_*, rh_open_*, rh_ctx, rh_callback).
# Prints "c layers ok" when every edge points down.
set -euo pipefail
lib=${1:?usage: check_c_layers.sh path/to/librhhost.a}
command -v nm >/dev/null || { echo "nm is not installed (binutils)" >&2; exit 1; }

# the floors of host/tensor, lowest first (a file not listed is outside the core)
floor_of() {
  case "$1" in
    errmsg.c.o | parallel.c.o) echo 0 ;;
    device.c.o) echo 1 ;;
    storage.c.o) echo 2 ;;
    tensor.c.o | iter.c.o) echo 3 ;;
    copy.c.o) echo 4 ;;
    reduce.c.o) echo 5 ;;
    ops.c.o) echo 6 ;;
    matmul.c.o | index.c.o | sort.c.o | random.c.o | generator.c.o) echo 7 ;;
    nn_*.c.o) echo 8 ;;
    *) echo -1 ;;
  esac
}

# "object defined-or-undefined symbol" for every global rh symbol
# (nm -A writes "lib.a:obj.o:address T symbol", or "lib.a:obj.o: U symbol")
table=$(nm -A "$lib" 2>/dev/null | awk 'NF == 3 && $3 ~ /^rh/ {
  n = split($1, p, ":"); obj = p[n - 1]
  if ($2 ~ /^[TDBR]$/) print obj, "D", $3
  else if ($2 == "U") print obj, "U", $3
}')
declare -A where
while read -r obj kind sym; do
  [ "$kind" = D ] && where[$sym]=$obj
done <<<"$table"

bad=0
while read -r obj kind sym; do
  [ "$kind" = U ] || continue
  case "$sym" in
    rh_lua_* | rh_open_* | rh_ctx | rh_callback | rh_pushref | rh_unref)
      echo "$obj calls $sym: host/ calls nothing in bindings/" >&2
      bad=1
      continue
      ;;
  esac
  def=${where[$sym]:-}
  [ -n "$def" ] || continue # (defined outside the library: libc, libuv, BLAS)
  fu=$(floor_of "$obj")
  fd=$(floor_of "$def")
  [ "$fu" -ge 0 ] && [ "$fd" -ge 0 ] || continue
  if [ "$fd" -gt "$fu" ] || { [ "$fd" -eq "$fu" ] && [ "$fu" -lt 7 ] && [ "$def" != "$obj" ]; }; then
    echo "${obj%.o} calls $sym of ${def%.o}: a call up (or across) the tensor core's floors" >&2
    bad=1
  fi
done <<<"$table"
[ "$bad" -eq 0 ] && echo "c layers ok"
exit "$bad"
