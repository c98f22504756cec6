#!/usr/bin/env bash
# Checks a GPU node before a training run: loads that node's torch libraries (libtorch, CUDA,
# and the same libnccl.so.2 that libtorch uses) and runs collect_env's self-test on every GPU.
#
#   examples/check_gpu_node.sh [PYTHON]       PYTHON: an interpreter whose torch is 2.11 (default python3)
#
# Binaries come from $MEGATRON_RS_BIN (default: target/release of this checkout), so a node that
# has torch but no Rust toolchain can run binaries built elsewhere and copied over.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin_dir=${MEGATRON_RS_BIN:-$here/target/release}

source "$here/scripts/torch-env.sh" "${1:-python3}"
command -v nvidia-smi >/dev/null && nvidia-smi -L
"$bin_dir/collect_env" --self-test
