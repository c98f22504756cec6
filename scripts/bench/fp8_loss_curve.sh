#!/usr/bin/env bash
# FP8 against bf16 (issue 20): our pretrain_gpt trained for ITERS steps on the same mock data,
# once in bf16 and once per fp8 variant, one after the other on the same GPU. Prints the loss
# every 10 steps side by side, then each run's tokens/s (mean over the log intervals after the
# first two), MFU (counted against the dense bf16 peak for every row, fp8 included), peak GPU
# memory and its speed-up over bf16.
#
# Default shape: GPT-345M (24 layers, hidden 1024, 16 heads, seq 1024), micro batch 8, global
# batch 16, bf16, dropout 0, the same seed for every run.
#
# Environment (all optional):
#   PRETRAIN_GPT=path     the binary [default: target/release/pretrain_gpt, built here]
#   PYTHON=python3        a python with torch 2.11 (CUDA), for the library path and the table
#   ITERS=200             steps per run
#   GLOBAL_BATCH=16       global batch size (micro batch 8)
#   HIDDEN_SIZE=1024      hidden size (2048 with NUM_HEADS=32 is GPT-1.3B)
#   NUM_HEADS=16          attention heads
#   FP8_VARIANTS="--fp8-format hybrid;--fp8-format hybrid --fp8-recipe tensorwise;
#                 --fp8-format hybrid --no-fp8-wgrad"
#                         ;-separated flag sets, one fp8 run each (delayed scaling, current
#                         scaling, and delayed with the weight gradients in bf16)
#   EXTRA_FLAGS=""        more flags for every run
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
ITERS="${ITERS:-200}"
if [[ -z "${PRETRAIN_GPT:-}" ]]; then
    (cd "$ROOT" && cargo build --release --quiet -p pretrain_gpt)
    PRETRAIN_GPT="${CARGO_TARGET_DIR:-$ROOT/target}/release/pretrain_gpt"
fi
# shellcheck source=../torch-env.sh
source "$ROOT/scripts/torch-env.sh" "$PYTHON"
SCRATCH="$(mktemp -d -t fp8-bench.XXXXXX)"
# shellcheck source=gpu_memory.sh
source "$ROOT/scripts/bench/gpu_memory.sh"
trap '[[ -n "$SAMPLER" ]] && kill "$SAMPLER" 2>/dev/null; rm -rf "$SCRATCH"' EXIT

"$PYTHON" "$ROOT/scripts/bench/mock_gpt2_vocab.py" "$SCRATCH"

# shellcheck disable=SC2206
EXTRA=(${EXTRA_FLAGS:-})
RUN=("$PRETRAIN_GPT" --num-layers 24 --hidden-size "${HIDDEN_SIZE:-1024}"
     --num-attention-heads "${NUM_HEADS:-16}" --seq-length 1024 --max-position-embeddings 1024
     --micro-batch-size 8 --global-batch-size "${GLOBAL_BATCH:-16}" --bf16
     --hidden-dropout 0 --attention-dropout 0 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine
     --lr-warmup-iters "$((ITERS / 10))" --clip-grad 1.0 --weight-decay 0.1 --seed 1234 --train-iters "$ITERS"
     --log-interval 10 --eval-interval 100000 --eval-iters 1 --split 98,1,1 --mock-data
     --vocab-file "$SCRATCH/vocab.json" --merge-file "$SCRATCH/merges.txt" --log-throughput
     "${EXTRA[@]}")

run() {
    local name="$1" label="$2"
    shift 2
    echo "== $label" >&2
    echo "$label" >"$SCRATCH/$name.label"
    exec 3>"$SCRATCH/$name.mem"
    with_memory_peak "${RUN[@]}" "$@" >"$SCRATCH/$name.log"
    exec 3>&-
    cat "$SCRATCH/$name.log" >&2
}

run run0 "bf16"
DEFAULT_VARIANTS="--fp8-format hybrid;--fp8-format hybrid --fp8-recipe tensorwise"
DEFAULT_VARIANTS+=";--fp8-format hybrid --no-fp8-wgrad"
IFS=';' read -r -a variants <<<"${FP8_VARIANTS:-$DEFAULT_VARIANTS}"
for i in "${!variants[@]}"; do
    read -r -a flags <<<"${variants[$i]}"
    run "run$((i + 1))" "${variants[$i]}" "${flags[@]}"
done

"$PYTHON" "$ROOT/scripts/bench/loss_curve_table.py" "$SCRATCH"
