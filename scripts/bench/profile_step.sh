#!/usr/bin/env bash
# Where a training step's GPU time goes, for our pretrain_gpt and for the PyTorch reference of the
# same model (scripts/bench/reference_gpt.py, torch.compile by default) in the same run: both are
# traced with libtorch's Kineto profiler (ours through `--profile --use-pytorch-profiler`) over
# PROFILE_ITERS steps after warm-up, and scripts/bench/profile_summary.py breaks each step into
# GEMMs, attention, normalisation, cross entropy, optimizer, communication, other elementwise
# kernels, memory copies and host gaps.
#
# Default shape: GPT-345M (24 layers, hidden 1024, 16 heads, seq 1024), micro batch 8, global
# batch 8 (GLOBAL_BATCH), bf16, synthetic data (--mock-data, a GPT-2-sized vocabulary).
#
# Environment (all optional):
#   PRETRAIN_GPT=path     the binary to profile [default: target/release/pretrain_gpt, built here]
#   PYTHON=python3        a python with torch 2.11 (CUDA)
#   REFERENCE=compile     compile, eager or none
#   PROFILE_ITERS=2       profiled steps (after 8 warm-up steps)
#   EXTRA_FLAGS=""        more flags for both runs (e.g. "--hidden-dropout 0 --attention-dropout 0")
#   OURS_FLAGS=""         more flags for ours only (e.g. "--cross-entropy-loss-fusion")
#   GLOBAL_BATCH=8        global batch size (micro batch 8): above 8 a step holds several
#                         micro-batches and the optimizer step's share shrinks
#   HIDDEN_SIZE=1024      hidden size (2048 with NUM_HEADS=32 is GPT-1.3B)
#   NUM_HEADS=16          attention heads
#   TRACE_DIR=dir         keep the traces here [default: a temporary directory]
#   TOP=0                 also list each run's N most expensive kernels
#   OURS_VARIANTS=""      ;-separated flag sets, each profiling ours once more with them, as in
#                         pretrain_gpt.sh (NAME=value words go to the environment), e.g.
#                         "MEGATRON_RS_OPTIMIZER_KERNELS=0" for the step on ATen's kernels,
#                         "MEGATRON_RS_FUSED_ADD_NORM=0" for the residual adds and norms unfused
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
REFERENCE="${REFERENCE:-compile}"
PROFILE_ITERS="${PROFILE_ITERS:-2}"
WARMUP=8
if [[ -z "${PRETRAIN_GPT:-}" ]]; then
    (cd "$ROOT" && cargo build --release --quiet -p pretrain_gpt)
    PRETRAIN_GPT="${CARGO_TARGET_DIR:-$ROOT/target}/release/pretrain_gpt"
fi
# shellcheck source=../torch-env.sh
source "$ROOT/scripts/torch-env.sh" "$PYTHON"
# shellcheck source=ours_variants.sh
source "$ROOT/scripts/bench/ours_variants.sh"
SCRATCH="$(mktemp -d -t profile-step.XXXXXX)"
trap 'rm -rf "$SCRATCH"' EXIT
TRACE_DIR="${TRACE_DIR:-$SCRATCH}"
mkdir -p "$TRACE_DIR"
"$PYTHON" "$ROOT/scripts/bench/mock_gpt2_vocab.py" "$SCRATCH"

SHAPE=(--num-layers 24 --hidden-size "${HIDDEN_SIZE:-1024}" --num-attention-heads "${NUM_HEADS:-16}" --seq-length 1024
       --max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size "${GLOBAL_BATCH:-8}" --bf16)
# shellcheck disable=SC2206
EXTRA=(${EXTRA_FLAGS:-})
# shellcheck disable=SC2206
OURS_EXTRA=(${OURS_FLAGS:-})
ITERS=$((WARMUP + PROFILE_ITERS))

OURS=("$PRETRAIN_GPT" "${SHAPE[@]}" "${EXTRA[@]}" "${OURS_EXTRA[@]}" --lr 1.5e-4 --train-iters "$ITERS"
      --log-interval "$ITERS" --eval-interval 100000 --eval-iters 1 --split 98,1,1 --mock-data
      --vocab-file "$SCRATCH/vocab.json" --merge-file "$SCRATCH/merges.txt"
      --profile --use-pytorch-profiler --profile-step-start "$WARMUP" --profile-step-end "$ITERS")
echo "== ours: $PRETRAIN_GPT" >&2
"${OURS[@]}" --tensorboard-dir "$SCRATCH/ours" >&2
cp "$SCRATCH/ours/trace_rank0_iter${WARMUP}-${ITERS}.json" "$TRACE_DIR/ours.json"
TRACES=("$TRACE_DIR/ours.json")
LABELS=(megatron-rs)
IFS=';' read -r -a VARIANTS <<<"${OURS_VARIANTS:-}"
for i in "${!VARIANTS[@]}"; do
    split_variant "${VARIANTS[$i]}"
    echo "== ours with ${VARIANTS[$i]}" >&2
    env "${VARIANT_ENV[@]}" "${OURS[@]}" "${VARIANT_FLAGS[@]}" \
        --tensorboard-dir "$SCRATCH/variant$i" >&2
    cp "$SCRATCH/variant$i/trace_rank0_iter${WARMUP}-${ITERS}.json" "$TRACE_DIR/variant$i.json"
    TRACES+=("$TRACE_DIR/variant$i.json")
    LABELS+=("ours ${VARIANTS[$i]}")
done

if [[ "$REFERENCE" != none ]]; then
    echo "== reference: PyTorch $REFERENCE" >&2
    COMPILE=()
    [[ "$REFERENCE" == compile ]] && COMPILE=(--torch-compile)
    "$PYTHON" "$ROOT/scripts/bench/reference_gpt.py" "${SHAPE[@]}" "${EXTRA[@]}" "${COMPILE[@]}" \
        --train-iters "$ITERS" --log-interval "$ITERS" --profile-iters "$PROFILE_ITERS" \
        --profile-trace "$TRACE_DIR/reference.json" >&2
    TRACES+=("$TRACE_DIR/reference.json")
    LABELS+=("pytorch-$REFERENCE")
fi

"$PYTHON" "$ROOT/scripts/bench/profile_summary.py" --steps "$PROFILE_ITERS" "${TRACES[@]}" --labels "${LABELS[@]}" \
    --top "${TOP:-0}"
