#!/usr/bin/env bash
# Batch-1 decode steps on one GPU, GPT-345M shape (24 layers, hidden 1024, 16 heads) in bf16
# with random weights: lib/inference/examples/decode_step.rs times steps with the argmax read on the
# host after each and as the server runs them (the next step queued first, reading the argmax on
# the GPU), with the fused decode kernels and with --no-decode-fusion, then
# scripts/bench/profile_summary.py lists the kernels of 20 traced steps of each (as the server
# runs them).
#
# Environment (all optional):
#   PYTHON=python3          a python with torch 2.11 (CUDA), for the library path and the summary
#   PRETRAIN_GPT=path       makes the checkpoint [default: target/release/pretrain_gpt, built here]
#   DECODE_STEP=path        the example binary [default: target/release/examples/decode_step]
#   TOP=12                  kernels listed per run
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
if [[ -z "${PRETRAIN_GPT:-}" || -z "${DECODE_STEP:-}" ]]; then
    (cd "$ROOT" && cargo build --release --quiet -p pretrain_gpt \
        && cargo build --release --quiet -p megatron-inference --example decode_step)
fi
PRETRAIN_GPT="${PRETRAIN_GPT:-${CARGO_TARGET_DIR:-$ROOT/target}/release/pretrain_gpt}"
DECODE_STEP="${DECODE_STEP:-${CARGO_TARGET_DIR:-$ROOT/target}/release/examples/decode_step}"
# shellcheck source=../torch-env.sh
source "$ROOT/scripts/torch-env.sh" "$PYTHON"
SCRATCH="$(mktemp -d -t decode-step.XXXXXX)"
trap 'rm -rf "$SCRATCH"' EXIT

"$PRETRAIN_GPT" --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 \
    --max-position-embeddings 1024 --tokenizer-type NullTokenizer --vocab-size 50256 \
    --micro-batch-size 1 --global-batch-size 1 --train-iters 1 --lr 1e-4 --bf16 --mock-data \
    --eval-iters 0 --save "$SCRATCH/ckpt" >"$SCRATCH/train.log" 2>&1 \
    || { tail -20 "$SCRATCH/train.log" >&2; exit 1; }
"$DECODE_STEP" "$SCRATCH/ckpt" "$SCRATCH/trace"
"$PYTHON" "$ROOT/scripts/bench/profile_summary.py" --steps 20 "$SCRATCH/trace_fused.json" \
    "$SCRATCH/trace_unfused.json" --labels fused unfused --top "${TOP:-12}"
