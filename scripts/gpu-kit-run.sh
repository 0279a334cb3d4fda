#!/usr/bin/env bash
# run.sh of the zoe GPU validation kit (scripts/gpu-kit.sh copies it into the bundle): on a
# machine with an NVIDIA GPU and PyTorch 2.x, runs the CUDA device conformance tests, the CUDA
# AdamW kernel against the CPU kernels, zoe.torch.AdamW on a CUDA model against torch's AdamW and
# offload_parameters on a CUDA model, then prints a summary. Without a GPU it says so and exits 0.
# Usage: ./run.sh   (PYTHON: the interpreter with torch, default python3; logs go to ./logs)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export ZOE_LIBRARY="$here/lib/libzoe.so" PYTHONPATH="$here/python" ZOE_LOG_LEVEL=warn

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-kit: no NVIDIA GPU here (nvidia-smi finds none); nothing run"
  exit 0
fi
nvidia-smi -L
mkdir -p "$here/logs"
results=()
failed=0

# run NAME COMMAND...: runs one part, its output to logs/NAME.log. A part that skipped cases
# (GoogleTest's "[  SKIPPED ]", pytest's "N skipped": no CUDA backend, or torch sees no GPU)
# counts as failed: the kit exists to run them.
run() {
  local name=$1
  shift
  local log="$here/logs/$name.log"
  echo "== $name"
  "$@" >"$log" 2>&1
  local status=$?
  if [[ $status -eq 0 ]] && grep -Eq "\[  SKIPPED \]|[0-9]+ skipped" "$log"; then
    status=77
  fi
  tail -n 5 "$log"
  case $status in
    0) results+=("PASS  $name") ;;
    77) results+=("FAIL  $name (cases skipped; see logs/$name.log)"); failed=1 ;;
    *) results+=("FAIL  $name (exit $status; see logs/$name.log)"); failed=1 ;;
  esac
}

run cuda-device-conformance "$here/bin/zoe_core_tests" \
  --gtest_filter='Backends/DeviceConformance.*/cuda:CreateDeviceBackend.*'
run cuda-adamw-kernel "$here/bin/zoe_optim_tests" --gtest_filter='CudaAdamW.*'
run zoe-torch-cuda "$python" -m pytest -q -rs -p no:cacheprovider "$here/tests/test_torch_cuda.py"

echo
echo "gpu-kit summary ($(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1))"
printf '  %s\n' "${results[@]}"
exit $failed
