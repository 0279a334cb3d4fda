#!/usr/bin/env bash
# Sets up a machine and runs every zoe test: installs the Debian packages zoe needs, then builds
# and runs the GoogleTest suites in the release, asan (ASan+UBSan) and tsan presets, and the
# Python tests under /usr/bin/python3 (against the release library and, at the same time,
# against the ASan+UBSan library when the asan preset is built in the same run), and the
# libFuzzer targets for a bounded time (scripts/run-fuzzers.sh). At the end it fails the run if
# any test skipped for a reason tests/allowed-skips.txt does not allow (scripts/check-skips.py:
# only "no GPU"-class and sanitizer reasons are allowed), reading the JUnit files of every ctest
# and pytest run. Before any of it, no product function may be longer than 60 lines
# (scripts/function-lengths.py).
# Usage: scripts/run-tests.sh [preset ...]     (default: release asan tsan python fuzz)
set -euo pipefail
cd "$(dirname "$0")/.."

"$(pwd)/scripts/install-deps.sh"

jobs=$(nproc)
presets=("$@")
((${#presets[@]})) || presets=(release asan tsan python fuzz)

# The environment of every ctest and pytest run (not of the fuzzers):
# - ZOE_REQUIRE_TORCH=1: the torch reference test fails instead of skipping when /usr/bin/python3
#   cannot import torch (install-deps.sh installs python3-torch).
# - ZOE_DEVICE_ADVERSARIAL_US: every host stand-in device that CreateDeviceBackend makes (engines
#   with zoe.device "host", or "auto" without a GPU) runs in adversarial mode: each copy completes
#   this many microseconds after it starts and its destination reads as poison (NaN) until then,
#   so a missing wait fails a test instead of passing by luck. 200 us is far longer than code
#   takes from submitting a copy to using its destination, and copies on one queue run one after
#   another, so a test costs 0.2 ms per device copy.
# - ZOE_REQUIRE_ISAS: the optimizer kernels' instruction-set paths this CPU has, as /proc/cpuinfo
#   shows them (cpu_isas: AVX-512 with bf16 and VBMI, AVX-512, AVX2 with FMA and F16C); the
#   parity tests fail where zoe's detection finds fewer (a path left untested) instead of passing
#   silently. Set it to require another list.
cpu_isas() {
  local flags isas=()
  flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  has() { local flag; for flag; do [[ $flags == *" $flag "* ]] || return 1; done; }
  if has avx512f avx512bw avx512vl avx512dq; then
    if has avx512_bf16 avx512vbmi; then isas+=(avx512bf16); fi
    isas+=(avx512)
  fi
  if has avx2 fma f16c; then isas+=(avx2); fi
  (IFS=,; echo "${isas[*]}")
}
test_env=(ZOE_REQUIRE_TORCH=1 ZOE_DEVICE_ADVERSARIAL_US=200
  "ZOE_REQUIRE_ISAS=${ZOE_REQUIRE_ISAS-$(cpu_isas)}")

# JUnit XML of each ctest and pytest run of this invocation, for check_skips. Removed first so a
# file left by an earlier run never stands in for one of this run.
junit_dir="$(pwd)/build/junit"
junit_files=()
rm -rf "$junit_dir"
mkdir -p "$junit_dir"

run_ctest_preset() {
  local preset=$1 started=$SECONDS
  echo "=== $preset: configure and build"
  cmake --preset "$preset" >"build/$preset.log" 2>&1 || { cat "build/$preset.log"; exit 1; }
  cmake --build --preset "$preset" -j "$jobs" >>"build/$preset.log" 2>&1 ||
    { tail -n 100 "build/$preset.log"; exit 1; }
  echo "=== $preset: test (built in $((SECONDS - started))s)"
  # Whole outputs in the JUnit file (ctest keeps 1 KiB of a passed test's by default): a skipped
  # case inside a ctest test that runs several (offload.checksums_avx2) is found in its output.
  junit_files+=("$junit_dir/$preset.xml")
  env "${test_env[@]}" ctest --preset "$preset" -j "$jobs" --output-junit "$junit_dir/$preset.xml" \
    --test-output-size-passed 4194304 --test-output-size-failed 4194304 \
    --test-output-truncation middle
}

# One pytest run of every Python test against the library $2, named $1 (its JUnit file and its
# log, build/python-$1.log); extra environment assignments follow.
run_pytest() {
  local name=$1 library=$2
  shift 2
  env "${test_env[@]}" "$@" ZOE_LIBRARY="$library" PYTHONPATH="$(pwd)/integrations/python" \
    /usr/bin/python3 -m pytest -q -rs --junitxml="$junit_dir/python-$name.xml" \
    integrations/python/tests >"build/python-$name.log" 2>&1
}

run_python_tests() {
  if ! compgen -G "integrations/python/tests/test_*.py" >/dev/null; then
    echo "=== python: no Python tests yet"
    return
  fi
  [[ -f build/release/integrations/libzoe.so ]] || run_ctest_preset release
  local names=(release) pids=() failed=0 index
  # When this run built the asan preset, the same tests drive the ASan+UBSan library through
  # ctypes, at the same time as the release library's run (each is mostly one process, and
  # the machine has two cores or more). The sanitizer runtimes must load before the
  # interpreter; leak detection is off because CPython does not free everything at exit (the C
  # and C++ tests check zoe's leaks).
  echo "=== python: pytest under /usr/bin/python3 against the release library"
  run_pytest release "$(pwd)/build/release/integrations/libzoe.so" &
  pids+=($!)
  if [[ " ${presets[*]} " == *" asan "* && -f build/asan/integrations/libzoe.so ]]; then
    echo "=== python: and, at the same time, against the ASan+UBSan library"
    names+=(asan)
    run_pytest asan "$(pwd)/build/asan/integrations/libzoe.so" \
      LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)" \
      ASAN_OPTIONS=detect_leaks=0 &
    pids+=($!)
  fi
  for index in "${!pids[@]}"; do
    junit_files+=("$junit_dir/python-${names[index]}.xml")
    wait "${pids[index]}" || failed=1
    echo "=== python (${names[index]} library):"
    cat "build/python-${names[index]}.log"
  done
  ((failed == 0)) || { echo "python: a pytest run failed (above)" >&2; exit 1; }
}

# The GPU kit (scripts/gpu-kit.sh), bundled from the release build: it must fit what a lent GPU
# machine takes (the script fails above ZOE_KIT_MAX_MIB, 48), and the limit must hold (a 1 MiB
# limit is refused). Where nvcc is missing the release build has no CUDA and there is no kit.
check_gpu_kit() {
  if ! command -v nvcc >/dev/null 2>&1 && [[ ! -x /usr/local/cuda/bin/nvcc ]]; then
    echo "=== gpu kit: no nvcc on this machine, no kit to check"
    return
  fi
  echo "=== gpu kit: bundled from the release build, at most 48 MiB"
  ZOE_KIT_BUILD_DIR=build/release scripts/gpu-kit.sh build/gpu-kit
  if ZOE_KIT_BUILD_DIR=build/release ZOE_KIT_MAX_MIB=1 scripts/gpu-kit.sh build/gpu-kit-limit \
    >/dev/null 2>&1; then
    echo "gpu kit: a 1 MiB limit was not enforced" >&2
    exit 1
  fi
  rm -rf build/gpu-kit-limit
}

# Fails the run if a test skipped for a reason tests/allowed-skips.txt does not allow, listing
# each with its reason, and prints a count of the skips by reason. Every JUnit file a run above
# announced must exist.
check_skips() {
  if ((${#junit_files[@]} == 0)); then
    echo "=== skips: no ctest or pytest run in this invocation"
    return
  fi
  /usr/bin/python3 scripts/check-skips.py --allow tests/allowed-skips.txt "${junit_files[@]}"
}

# The longest function of the product code (tests and benchmarks aside) is at most 60 lines
# (scripts/function-lengths.py); checked first, it takes a second.
echo "=== function lengths"
/usr/bin/python3 scripts/function-lengths.py --max 60 --top 5

# Each phase's wall time, printed at the end: where a run's time goes (CI keeps the whole run
# under an hour on two cores).
timings=()
mkdir -p build
for preset in "${presets[@]}"; do
  started=$SECONDS
  case $preset in
    release)
      run_ctest_preset release
      check_gpu_kit
      ;;
    debug | asan | tsan) run_ctest_preset "$preset" ;;
    python) run_python_tests ;;
    fuzz) ./scripts/run-fuzzers.sh ;;
    *) echo "unknown preset '$preset'; allowed: release debug asan tsan python fuzz" >&2; exit 2 ;;
  esac
  timings+=("$preset $((SECONDS - started))s")
done
check_skips
echo "=== wall time by phase: ${timings[*]} (total ${SECONDS}s)"
echo "=== all requested test runs passed: ${presets[*]}"
