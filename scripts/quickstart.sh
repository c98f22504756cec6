#!/usr/bin/env bash
# The quickstart: sets itself up, builds the toolkit in release mode, and runs the main job on the
# bundled default. Today that is the machine report and self-test (libtorch, CUDA devices, NCCL,
# bf16 matmul, flash/SDPA attention and the autograd shim on every device); the data and training
# stages join as their tools land (see README's table of binaries).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

scripts/setup.sh
cargo build --locked --release --workspace --bins
target/release/collect_env --self-test
