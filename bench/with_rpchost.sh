#!/bin/sh
# bench/with_rpchost.sh DRIVER.py [ARGS...]: what every bench/*.sh does. Builds
# build/rpchost if it is missing (never deletes build/; $RPCHOST names another
# binary), then runs bench/DRIVER.py with Debian's /usr/bin/python3 (the one with
# python3-torch; a pyenv `python3` shim would not have torch), passing ARGS on.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
driver=$1
shift
if [ -z "${RPCHOST:-}" ] && [ ! -x "$root/build/rpchost" ]; then
  echo "bench: building rpchost into $root/build" >&2
  cmake -S "$root" -B "$root/build" >/dev/null
  cmake --build "$root/build" -j2 >/dev/null
fi
exec /usr/bin/python3 "$root/bench/$driver" "$@"
