#!/usr/bin/env bash
# Sets up a machine and runs the zoe demo: installs the Debian packages zoe needs, builds libzoe.so
# (release preset), then trains a small character-level GPT with its parameters and optimizer
# state offloaded to NVMe files in a temporary directory, next to the same training with
# torch.optim.AdamW and no offload (examples/train_gpt.py; see examples/README.md); then trains
# a GPT whose training state is over 4x the memory it is allowed (examples/train_beyond_memory.py).
# Usage: scripts/run-demo.sh [train_gpt.py options, e.g. --steps 100 --plot out.png]
set -euo pipefail
cd "$(dirname "$0")/.."

"$(pwd)/scripts/install-deps.sh"
mkdir -p build
cmake --preset release >build/release.log 2>&1 || { cat build/release.log; exit 1; }
cmake --build --preset release -j "$(nproc)" --target zoe >>build/release.log 2>&1 ||
  { tail -n 100 build/release.log; exit 1; }

export ZOE_LIBRARY="$(pwd)/build/release/integrations/libzoe.so"
export PYTHONPATH="$(pwd)/integrations/python"
/usr/bin/python3 examples/train_gpt.py --plot build/zoe-demo.png "$@"
echo
# A GPT whose training state is over 4x the memory it may use (a memory cgroup, as root).
exec /usr/bin/python3 examples/train_beyond_memory.py
