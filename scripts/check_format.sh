#!/usr/bin/env bash
# The suite's style.format test: every C, C++ and CUDA file of the project is
# as clang-format writes it with the checked-in .clang-format (STYLE.md).
# Run `clang-format -i FILE` on a file it names to fix it.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v clang-format >/dev/null; then
  echo "clang-format is not installed: install the Debian package clang-format (scripts/setup.sh does)" >&2
  exit 1
fi
files=$(find host bindings kernels tests bench spec -name build -prune -o \
  \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.cpp' \) -print | sort)
if clang-format --dry-run --Werror $files; then
  echo "format ok: $(echo "$files" | wc -l) files"
else
  echo "these files are not in the house format: run clang-format -i on them" >&2
  exit 1
fi
