#!/usr/bin/env bash
# Compiles every kernel source of lib/kernels/cuda/ alone with nvcc, as compute-sanitizer and
# the profilers' tools take them (the product hands them to NVRTC at run time): each .cu for
# sm_90a, and those that do not say `// requires: sm_89` for sm_80 too. Prints one line per file and stops
# at the first failure with nvcc's output. Needs the CUDA toolkit: nvcc on PATH, or $NVCC.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

nvcc=${NVCC:-nvcc}
if ! command -v "$nvcc" >/dev/null; then
  echo "check_cuda_sources: error: no $nvcc (put the CUDA toolkit's bin on PATH or set NVCC)" >&2
  exit 1
fi

folder=lib/kernels/cuda
objects=$(mktemp -d)
trap 'rm -rf "$objects"' EXIT

for file in "$folder"/*.cu; do
  name=$(basename "$file")
  # A source that needs sm_89 or newer says so on a line of its own (fp8_cast's e4m3/e5m2
  # conversions); lib/kernels/tests/cuda_sources.rs reads the same line.
  archs=(sm_80 sm_90a)
  grep -qx '// requires: sm_89' "$file" && archs=(sm_90a)
  for arch in "${archs[@]}"; do
    if ! output=$("$nvcc" -std=c++17 -arch="$arch" -I "$folder" -c -o "$objects/${name%.cu}.$arch.o" "$file" 2>&1); then
      echo "FAILED  $name ($arch)"
      echo "$output" >&2
      exit 1
    fi
  done
  echo "ok      $name (${archs[*]})"
done
