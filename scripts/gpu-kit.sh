#!/usr/bin/env bash
# Builds zoe with CUDA on and bundles what a machine with a GPU needs to validate it into one
# folder: libzoe.so and the shared libraries it and the test programs link (glibc and the CUDA
# driver excepted: the GPU machine has its own), the GPU test programs, the Python package, the
# GPU Python tests, and run.sh, which runs them there (see docs/gpu.md).
# Usage: scripts/gpu-kit.sh [bundle folder, default build/gpu-kit]
#   ZOE_KIT_BUILD_DIR: the build folder (default build/gpu-kit-build; build/release reuses the
#   release build when it was configured with CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
bundle=${1:-build/gpu-kit}
build=${ZOE_KIT_BUILD_DIR:-build/gpu-kit-build}
programs=(zoe_core_tests zoe_optim_tests)

nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
if [[ ! -x "$nvcc" ]]; then
  echo "gpu-kit: nvcc not found (PATH or /usr/local/cuda/bin); the kit needs CUDA" >&2
  exit 1
fi
mkdir -p "$(dirname "$build")"
cmake --preset release -B "$build" -DZOE_WITH_CUDA=ON >"$build.log" 2>&1 ||
  { cat "$build.log"; exit 1; }
cmake --build "$build" -j "${ZOE_KIT_JOBS:-$(nproc)}" --target zoe "${programs[@]}" \
  >>"$build.log" 2>&1 || { tail -n 100 "$build.log"; exit 1; }

rm -rf "$bundle"
mkdir -p "$bundle/lib" "$bundle/bin" "$bundle/python" "$bundle/tests"
cp -P "$build"/integrations/libzoe.so* "$bundle/lib/"
for program in "${programs[@]}"; do
  cp "$build/tests/$program" "$bundle/bin/"
done

# The shared libraries they link, found by ldd here, except glibc's own (libc, libm, libdl,
# libpthread, librt, the loader, the vDSO) and the CUDA driver, which belong to the GPU machine.
is_system() {
  case "$1" in
    linux-vdso.so.* | ld-linux*.so.* | libc.so.* | libm.so.* | libdl.so.* | libpthread.so.* | \
      librt.so.* | libcuda.so.*) return 0 ;;
  esac
  return 1
}
for binary in "$bundle"/lib/libzoe.so "$bundle"/bin/*; do
  ldd "$binary" | while read -r name arrow path _; do
    [[ "$arrow" == "=>" && -f "$path" ]] || continue
    is_system "$name" && continue
    [[ -e "$bundle/lib/$name" ]] || cp -L "$path" "$bundle/lib/$name"
  done
done

cp -r integrations/python/zoe "$bundle/python/"
find "$bundle/python" -name __pycache__ -prune -exec rm -rf {} +
cp integrations/python/tests/conftest.py integrations/python/tests/test_torch_cuda.py \
  "$bundle/tests/"
cp scripts/gpu-kit-run.sh "$bundle/run.sh"
chmod +x "$bundle/run.sh"
{
  echo "zoe GPU validation kit"
  echo "commit: $(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) with $("$nvcc" --version | tail -n 1)"
  echo "files:"
  (cd "$bundle" && find . -type f | sort | sed 's/^/  /')
} >"$bundle/MANIFEST"
echo "gpu-kit: bundle in $bundle ($(du -sh "$bundle" | cut -f1)); run $bundle/run.sh on a GPU machine"
