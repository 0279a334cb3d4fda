#!/usr/bin/env bash
# The one command to run on a lent GPU machine (NVIDIA GPU, driver 580+, Python 3 with torch 2.x
# built for CUDA 13 and pytest; no package registry needed), from a checkout that carries the kit
# scripts/gpu-kit.sh built (build/gpu-kit). It runs the kit's checks (run.sh: CUDA device tier,
# CUDA AdamW kernel, zoe.torch on a CUDA model, NCCL collectives) and the GPU iteration benchmark
# (bench/gpu_step.py), each under a time limit, and writes to OUT:
#   summary.json        the machine, the versions, each part's verdict and time, the benchmark
#   results.json        the kit's verdicts;  *.log: each part's output;  gpu-step.json
# Exit status 0 when every check passed. At most about 9 minutes (PART_TIMEOUT 240 s per check;
# the benchmark's STEPS/ROUNDS keep it near two minutes on an H100/H200).
# Usage: scripts/gpu-check.sh OUT [KIT, default build/gpu-kit]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-check.sh OUT [KIT]}
kit=${2:-build/gpu-kit}
python=${PYTHON:-python3}
mkdir -p "$out"
out=$(cd "$out" && pwd)
if [[ ! -x "$kit/run.sh" ]]; then
  echo "gpu-check: no kit at $kit (build it with scripts/gpu-kit.sh where nvcc is installed)" >&2
  exit 2
fi

# NCCL: torch's CUDA build depends on the nvidia-nccl wheel; zoe loads the same library.
nccl=$("$python" -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
[[ -n "$nccl" && -d "$nccl" ]] && export LD_LIBRARY_PATH="$nccl${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

"$python" - >"$out/environment.json" <<'PY'
import json, platform, subprocess, torch
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                      "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
print(json.dumps({"gpu": smi, "python": platform.python_version(), "torch": torch.__version__,
                  "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version()))
                  if torch.cuda.is_available() else None, "kernel": platform.release()}))
PY
cat "$out/environment.json"

start=$SECONDS
PYTHON="$python" "$kit/run.sh" "$out"
checks=$?

echo "== gpu-step benchmark"
bench_start=$SECONDS
LD_LIBRARY_PATH="$kit/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ZOE_LIBRARY="$kit/lib/libzoe.so" \
  PYTHONPATH="$kit/python" OUTPUT="$out/gpu-step.json" STEPS="${STEPS:-4}" ROUNDS="${ROUNDS:-3}" \
  timeout "${BENCH_TIMEOUT:-300}" "$python" "$kit/bench/gpu_step.py" >"$out/gpu-step.log" 2>&1
bench=$?
tail -n 40 "$out/gpu-step.log"

"$python" - "$out" "$checks" "$bench" $((SECONDS - start)) $((SECONDS - bench_start)) <<'PY'
import json, os, sys
out, checks, bench, seconds, bench_seconds = sys.argv[1], *map(int, sys.argv[2:])
def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
summary = {"environment": load("environment.json"), "checks": load("results.json"),
           "checks_exit": checks, "benchmark_exit": bench, "benchmark_seconds": bench_seconds,
           "benchmark": load("gpu-step.json"), "seconds": seconds}
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
print(json.dumps({k: summary[k] for k in ("checks_exit", "benchmark_exit", "seconds")}))
PY
exit $((checks != 0 || bench != 0))
