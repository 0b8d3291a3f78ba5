#!/usr/bin/env bash
# Verifies the arena's pinned-memory path (mlock + cudaHostRegister via dlopen'd libcudart,
# then a cudaMemcpy H2D/D2H round trip and H2D GB/s pinned vs pageable) on a GPU machine.
#
#   scripts/gpu_check.sh [MiB]        # default 256
#
# Needs only g++: CUDA is found at run time (set JAXASCEND_CUDART=/path/libcudart.so to choose
# one). Without a CUDA runtime or device it reports that and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${JAXASCEND_CUDART:-}" ]] && ! ldconfig -p 2>/dev/null | grep -q 'libcudart\.so'; then
  # Not in the loader cache: try the toolkit next to nvcc, then the usual install prefix.
  for dir in "$(dirname "$(command -v nvcc 2>/dev/null || echo /nonexistent/bin/nvcc)")/../lib64" /usr/local/cuda/lib64; do
    lib=$(ls "$dir"/libcudart.so* 2>/dev/null | head -n 1 || true)
    if [[ -n "$lib" ]]; then export JAXASCEND_CUDART="$lib"; break; fi
  done
fi
exe="${TMPDIR:-/tmp}/jaxascend_pinned_check.$$"
trap 'rm -f "$exe"' EXIT
g++ -std=c++17 -O2 -Wall -Iffi ffi/tools/pinned_check.cc ffi/ssd_arena.cc ffi/ssd_cuda_host.cc ffi/ssd_fault_injection.cc \
    -ldl -pthread -o "$exe"
"$exe" "${1:-256}"
