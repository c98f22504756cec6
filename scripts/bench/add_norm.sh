#!/usr/bin/env bash
# One residual add + norm of a training step on one GPU, fused (ops::add_norm) against
# libtorch's add and norm, forward and forward + backward, for GPT-345M's and GPT-1.3B's
# activations at micro batch 8 in bf16 (lib/models/examples/add_norm.rs prints the table in µs per
# call). The whole-step effect: OURS_VARIANTS="MEGATRON_RS_FUSED_ADD_NORM=0" with
# scripts/bench/pretrain_gpt.sh or scripts/bench/profile_step.sh.
#
# Environment (all optional):
#   PYTHON=python3          a python with torch 2.11 (CUDA), for the library path
#   ADD_NORM=path           the example binary [default: target/release/examples/add_norm, built here]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
if [[ -z "${ADD_NORM:-}" ]]; then
    (cd "$ROOT" && cargo build --release --quiet -p megatron-models --example add_norm)
fi
ADD_NORM="${ADD_NORM:-${CARGO_TARGET_DIR:-$ROOT/target}/release/examples/add_norm}"
# shellcheck source=../torch-env.sh
source "$ROOT/scripts/torch-env.sh" "$PYTHON"
"$ADD_NORM"
