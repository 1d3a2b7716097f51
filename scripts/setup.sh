#!/usr/bin/env bash
# Installs the Debian 12 packages rpchost needs to build and test, if any is missing.
# Run as root (or with sudo available). Does nothing when everything is present.
set -euo pipefail
pkgs=(build-essential cmake pkg-config libluajit-5.1-dev luajit libuv1-dev libmsgpack-dev
      libsodium-dev libopenblas-dev zlib1g-dev lua-busted python3-numpy clang clang-format libclang-rt-14-dev libedit-dev tmux
      openmpi-bin libopenmpi-dev python3-sklearn  # python3-sklearn: the 8x8 digits of scripts/examples/parameter_server
      slurm-wlm munge libmunge-dev)  # the slurm tier's one-node cluster; libmunge, which rpchost loads with dlopen
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
