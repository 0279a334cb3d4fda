#!/usr/bin/env bash
# Sets up a machine and runs every zoe test: installs the Debian packages zoe needs, then builds
# and runs the GoogleTest suites in the release, asan (ASan+UBSan) and tsan presets, and the
# Python tests under /usr/bin/python3.
# Usage: scripts/run-tests.sh [preset ...]     (default: release asan tsan python)
set -euo pipefail
cd "$(dirname "$0")/.."

"$(pwd)/scripts/install-deps.sh"

jobs=$(nproc)
presets=("$@")
((${#presets[@]})) || presets=(release asan tsan python)

run_ctest_preset() {
  local preset=$1
  echo "=== $preset: configure and build"
  cmake --preset "$preset" >"build/$preset.log" 2>&1 || { cat "build/$preset.log"; exit 1; }
  cmake --build --preset "$preset" -j "$jobs" >>"build/$preset.log" 2>&1 ||
    { tail -n 100 "build/$preset.log"; exit 1; }
  echo "=== $preset: test"
  ctest --preset "$preset" -j "$jobs"
}

run_python_tests() {
  if ! compgen -G "integrations/python/tests/test_*.py" >/dev/null; then
    echo "=== python: no Python tests yet"
    return
  fi
  [[ -f build/release/integrations/libzoe.so ]] || run_ctest_preset release
  echo "=== python: pytest under /usr/bin/python3"
  ZOE_LIBRARY="$(pwd)/build/release/integrations/libzoe.so" PYTHONPATH="$(pwd)/integrations/python" \
    /usr/bin/python3 -m pytest -q integrations/python/tests
}

mkdir -p build
for preset in "${presets[@]}"; do
  case $preset in
    release | debug | asan | tsan) run_ctest_preset "$preset" ;;
    python) run_python_tests ;;
    *) echo "unknown preset '$preset'; allowed: release debug asan tsan python" >&2; exit 2 ;;
  esac
done
echo "=== all requested test runs passed: ${presets[*]}"
