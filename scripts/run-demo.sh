#!/usr/bin/env bash
# Sets up a machine and runs the zoe demo: installs the Debian packages zoe needs, builds the
# release preset, and measures this machine's disk with `zoe bench io` on a temporary file
# (sequential write then read, 1 MiB blocks, queue depth 16, O_DIRECT), next to fio.
set -euo pipefail
cd "$(dirname "$0")/.."

"$(pwd)/scripts/install-deps.sh"
mkdir -p build
cmake --preset release >build/release.log 2>&1 || { cat build/release.log; exit 1; }
cmake --build --preset release -j "$(nproc)" --target zoe_cli >>build/release.log 2>&1 ||
  { tail -n 100 build/release.log; exit 1; }

workdir=$(mktemp -d "${TMPDIR:-/var/tmp}/zoe-demo.XXXXXX")
trap 'rm -rf "$workdir"' EXIT
for rw in write read; do
  ./build/release/bench/zoe bench io --path "$workdir" --rw "$rw" --bs 1M --iodepth 16 \
    --size 1G --compare-fio
done
