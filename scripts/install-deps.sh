#!/usr/bin/env bash
# Installs every Debian package zoe needs to build, test and run its demo. Idempotent: packages
# already present are skipped, so a machine that has them all makes no network call.
# Usage: scripts/install-deps.sh            (as root, or with sudo available)
set -euo pipefail

packages=(
  # toolchain
  build-essential cmake ninja-build pkg-config git clang-format
  # libFuzzer targets (scripts/run-fuzzers.sh)
  clang libclang-rt-14-dev
  # C++ libraries
  liburing-dev libaio-dev libhwloc-dev libboost-dev nlohmann-json3-dev libcli11-dev
  libspdlog-dev libfmt-dev libxxhash-dev libgtest-dev libgmock-dev libbenchmark-dev
  # benchmark peer and tools used by tests
  fio e2fsprogs util-linux procps
  # Python side: torch from Debian, run under /usr/bin/python3
  python3 python3-torch python3-numpy python3-pytest python3-tqdm python3-matplotlib
  # a fast BLAS for torch (Debian's torch otherwise runs the generic libblas: ~14x slower matmuls)
  libopenblas0-pthread
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
