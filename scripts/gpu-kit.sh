#!/usr/bin/env bash
# Builds zoe with CUDA on and bundles what a machine with a GPU needs to validate it into one
# folder: libzoe.so and the shared libraries it and the test programs link (stripped; glibc,
# libstdc++, libgcc_s and the CUDA driver excepted: a GPU machine with PyTorch has its own, newer
# ones (the C++ runtime goes in lib/cxx-runtime for a machine whose is older), and NCCL is not linked: libzoe loads the process's libnccl.so.2 at run time), the GPU test
# programs, the Python package, the GPU Python tests, the GPU benchmark, and run.sh, which runs
# them there (see docs/gpu.md). The bundle must stay within ZOE_KIT_MAX_MIB (48): a lent GPU
# machine takes 64 MiB in all, repository included.
# Usage: scripts/gpu-kit.sh [bundle folder, default build/gpu-kit]
#   ZOE_KIT_BUILD_DIR: the build folder (default build/gpu-kit-build; build/release reuses the
#   release build when it was configured with CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
bundle=${1:-build/gpu-kit}
build=${ZOE_KIT_BUILD_DIR:-build/gpu-kit-build}
programs=(zoe_core_tests zoe_optim_tests)
max_mib=${ZOE_KIT_MAX_MIB:-48}

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
mkdir -p "$bundle/lib" "$bundle/bin" "$bundle/python" "$bundle/tests" "$bundle/bench"
# The library the build's libzoe.so names (older versions may lie beside it), its soname link
# and libzoe.so.
library=$(readlink -f "$build/integrations/libzoe.so")
soname=$(objdump -p "$library" | awk '$1 == "SONAME" { print $2 }')
cp "$library" "$bundle/lib/"
ln -s "$(basename "$library")" "$bundle/lib/$soname"
ln -s "$soname" "$bundle/lib/libzoe.so"
for program in "${programs[@]}"; do
  cp "$build/tests/$program" "$bundle/bin/"
done

# The shared libraries they link, found by ldd here, except glibc's own (libc, libm, libdl,
# libpthread, librt, the loader, the vDSO), the C++ runtime (libstdc++, libgcc_s: the GPU
# machine's are newer, and torch there needs its own) and the CUDA driver.
is_system() {
  case "$1" in
    linux-vdso.so.* | ld-linux*.so.* | libc.so.* | libm.so.* | libdl.so.* | libpthread.so.* | \
      librt.so.* | libstdc++.so.* | libgcc_s.so.* | libcuda.so.* | libnccl.so.*) return 0 ;;
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

# The C++ runtime this was built with, used by run.sh only where the GPU machine's is older.
mkdir -p "$bundle/lib/cxx-runtime"
for name in libstdc++.so.6 libgcc_s.so.1; do
  path=$(ldd "$bundle/lib/libzoe.so" | awk -v n="$name" '$1 == n { print $3 }')
  [[ -n "$path" ]] && cp -L "$path" "$bundle/lib/cxx-runtime/$name"
done
find "$bundle/lib" "$bundle/bin" -type f -exec strip --strip-unneeded {} +

cp -r integrations/python/zoe "$bundle/python/"
find "$bundle/python" -name __pycache__ -prune -exec rm -rf {} +
cp integrations/python/tests/conftest.py integrations/python/tests/test_torch_cuda.py \
  integrations/python/tests/test_nccl_cuda.py integrations/python/tests/test_hf_cuda.py \
  integrations/python/tests/test_activations.py integrations/python/tests/test_activations_cuda.py \
  "$bundle/tests/"
cp bench/gpu_step.py "$bundle/bench/"
cp scripts/gpu-kit-run.sh "$bundle/run.sh"
chmod +x "$bundle/run.sh"
{
  echo "zoe GPU validation kit"
  echo "commit: $(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) with $("$nvcc" --version | tail -n 1)"
  echo "files:"
  (cd "$bundle" && find . -type f | sort | sed 's/^/  /')
} >"$bundle/MANIFEST"
kib=$(du -sk "$bundle" | cut -f1)
if ((kib > max_mib * 1024)); then
  echo "gpu-kit: the bundle is $((kib / 1024)) MiB, over the ${max_mib} MiB a GPU machine takes:" >&2
  (cd "$bundle" && du -ak . | sort -rn | head -n 12) >&2
  exit 1
fi
echo "gpu-kit: bundle in $bundle ($((kib / 1024)) MiB of at most ${max_mib}); run $bundle/run.sh on a GPU machine"
