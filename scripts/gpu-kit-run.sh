#!/usr/bin/env bash
# run.sh of the zoe GPU validation kit (scripts/gpu-kit.sh copies it into the bundle): on a
# machine with an NVIDIA GPU and PyTorch 2.x, runs the CUDA device conformance tests, the CUDA
# AdamW kernel against the CPU kernels, zoe.torch.AdamW on a CUDA model against torch's AdamW,
# offload_parameters on a CUDA model, and zoe's NCCL collectives over a real communicator, then
# prints a summary and writes it to LOGS/results.json. Without a GPU it says so and exits 0.
# Usage: ./run.sh [LOGS, default ./logs]   (PYTHON: the interpreter with torch, default python3)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
logs=$(mkdir -p "${1:-$here/logs}" && cd "${1:-$here/logs}" && pwd)
python=${PYTHON:-python3}
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The machine's C++ runtime serves (torch needs it too) unless it is older than the kit's.
if ldd -r "$here/lib/libzoe.so" 2>&1 | grep -q "GLIBCXX\|GCC_[0-9]"; then
  echo "gpu-kit: this machine's libstdc++ is older than the kit's; using lib/cxx-runtime"
  export LD_LIBRARY_PATH="$here/lib/cxx-runtime:$LD_LIBRARY_PATH"
fi
export ZOE_LIBRARY="$here/lib/libzoe.so" PYTHONPATH="$here/python" ZOE_LOG_LEVEL=warn

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-kit: no NVIDIA GPU here (nvidia-smi finds none); nothing run"
  exit 0
fi
nvidia-smi -L
results=()
json=()
failed=0

# run NAME COMMAND...: runs one part, its output to LOGS/NAME.log (at most PART_TIMEOUT seconds,
# default 240). A part that skipped cases (GoogleTest's "[  SKIPPED ]", pytest's "N skipped": no
# CUDA backend, or torch sees no GPU) counts as failed: the kit exists to run them.
run() {
  local name=$1
  shift
  local log="$logs/$name.log" start=$SECONDS
  echo "== $name"
  timeout "${PART_TIMEOUT:-240}" "$@" >"$log" 2>&1
  local status=$?
  if [[ $status -eq 0 ]] && grep -Eq "\[  SKIPPED \]|[0-9]+ skipped" "$log"; then
    status=77
  fi
  tail -n 5 "$log"
  local verdict=pass
  case $status in
    0) results+=("PASS  $name") ;;
    77) results+=("FAIL  $name (cases skipped; see $name.log)"); verdict=skipped; failed=1 ;;
    124) results+=("FAIL  $name (timed out; see $name.log)"); verdict=timeout; failed=1 ;;
    *) results+=("FAIL  $name (exit $status; see $name.log)"); verdict=fail; failed=1 ;;
  esac
  json+=("{\"part\": \"$name\", \"result\": \"$verdict\", \"exit\": $status, \"seconds\": $((SECONDS - start))}")
}

run cuda-device-conformance "$here/bin/zoe_core_tests" \
  --gtest_filter='Backends/DeviceConformance.*/cuda:CreateDeviceBackend.*'
run cuda-adamw-kernel "$here/bin/zoe_optim_tests" --gtest_filter='CudaAdamW.*'
run zoe-torch-cuda "$python" -m pytest -q -rs -p no:cacheprovider \
  "$here/tests/test_torch_cuda.py" "$here/tests/test_nccl_cuda.py" \
  "$here/tests/test_activations_cuda.py"
run hf-trainer-and-initialize "$python" -m pytest -q -rs -s -p no:cacheprovider \
  "$here/tests/test_hf_cuda.py"

gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1)
echo
echo "gpu-kit summary ($gpu)"
printf '  %s\n' "${results[@]}"
{
  echo "{\"gpu\": \"$gpu\", \"passed\": $((failed == 0 ? 1 : 0)), \"parts\": ["
  (IFS=,; echo "${json[*]}")
  echo "]}"
} >"$logs/results.json"
exit $failed
