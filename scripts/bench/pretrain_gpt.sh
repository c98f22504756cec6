#!/usr/bin/env bash
# Training speed of our pretrain_gpt against a plain PyTorch eager reference of the same model
# (scripts/bench/reference_gpt.py: SDPA attention, fused AdamW, bf16 autocast), one after the
# other on the same GPU: ms/iter, tokens/s, TFLOP/s, MFU and peak GPU memory (nvidia-smi,
# sampled every 100 ms, for both), then the speed ratio.
#
# Default shape: GPT-345M (24 layers, hidden 1024, 16 heads, seq 1024), micro batch 8, global
# batch 64, bf16, dropout 0.1, synthetic data (--mock-data with a GPT-2-sized vocabulary).
#
# Environment (all optional):
#   PRETRAIN_GPT=path     the binary to time [default: target/release/pretrain_gpt, built here]
#   PYTHON=python3        a python with torch 2.11 (CUDA) for the reference and the library path
#   ITERS=30              iterations per run; ours reports the mean of the last log interval
#                         (10, or half the run below 20 iterations)
#   TORCH_COMPILE=0       1 adds a torch.compile reference row
#   REFERENCE=eager       none runs ours and its variants alone, for models the reference lacks
#                         (e.g. EXTRA_FLAGS="--position-embedding-type rope" with
#                         OURS_VARIANTS="--no-rope-fusion": the fused RoPE's A/B)
#   GLOBAL_BATCH=64       global batch size
#   MICRO_BATCH=8         micro batch size
#   SEQ_LENGTH=1024       sequence length
#   PRECISION=bf16        bf16 or fp16 (Megatron's dynamic loss scaling; GradScaler in the
#                         references)
#   HIDDEN_SIZE=1024      hidden size (2048 with NUM_HEADS=32 is GPT-1.3B)
#   NUM_HEADS=16          attention heads
#   OURS_VARIANTS=""      ;-separated flag sets for extra rows of ours, e.g.
#                         "--no-gradient-accumulation-fusion;--cross-entropy-loss-fusion" (each
#                         lever measured on its own); NAME=value words are set in the run's
#                         environment ("MEGATRON_RS_OPTIMIZER_KERNELS=0": the optimizer step on
#                         ATen's kernels; "MEGATRON_RS_FUSED_ADD_NORM=0": the residual adds and
#                         norms unfused)
#   EXTRA_FLAGS=""        more flags for both runs (e.g. "--num-layers 48")
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
ITERS="${ITERS:-30}"
if [[ -z "${PRETRAIN_GPT:-}" ]]; then
    (cd "$ROOT" && cargo build --release --quiet -p pretrain_gpt)
    PRETRAIN_GPT="${CARGO_TARGET_DIR:-$ROOT/target}/release/pretrain_gpt"
fi
# shellcheck source=../torch-env.sh
source "$ROOT/scripts/torch-env.sh" "$PYTHON"
SCRATCH="$(mktemp -d -t pretrain-bench.XXXXXX)"
# shellcheck source=gpu_memory.sh
source "$ROOT/scripts/bench/gpu_memory.sh"
# shellcheck source=ours_variants.sh
source "$ROOT/scripts/bench/ours_variants.sh"
LOG_INTERVAL="$(log_interval "$ITERS")"
trap '[[ -n "$SAMPLER" ]] && kill "$SAMPLER" 2>/dev/null; rm -rf "$SCRATCH"' EXIT

"$PYTHON" "$ROOT/scripts/bench/mock_gpt2_vocab.py" "$SCRATCH"

case "${PRECISION:-bf16}" in
    bf16 | fp16) ;;
    *) echo "pretrain_gpt.sh: PRECISION takes bf16 or fp16, not $PRECISION" >&2; exit 2 ;;
esac
SHAPE=(--num-layers 24 --hidden-size "${HIDDEN_SIZE:-1024}" --num-attention-heads "${NUM_HEADS:-16}"
       --seq-length "${SEQ_LENGTH:-1024}" --max-position-embeddings "${SEQ_LENGTH:-1024}"
       --micro-batch-size "${MICRO_BATCH:-8}" --global-batch-size "${GLOBAL_BATCH:-64}"
       "--${PRECISION:-bf16}")
# shellcheck disable=SC2206
EXTRA=(${EXTRA_FLAGS:-})

OURS=("$PRETRAIN_GPT" "${SHAPE[@]}" "${EXTRA[@]}" --lr 1.5e-4 --train-iters "$ITERS"
      --log-interval "$LOG_INTERVAL" --eval-interval 100000 --eval-iters 1 --split 98,1,1 --mock-data
      --vocab-file "$SCRATCH/vocab.json" --merge-file "$SCRATCH/merges.txt" --log-throughput)

echo "== ours: $PRETRAIN_GPT" >&2
exec 3>"$SCRATCH/ours.mem"
with_memory_peak "${OURS[@]}" >"$SCRATCH/ours.log"
exec 3>&-
cat "$SCRATCH/ours.log" >&2
run_ours_variants "${OURS[@]}"

REFERENCES=()
if [[ "${REFERENCE:-eager}" != none ]]; then
    echo "== reference: PyTorch eager" >&2
    exec 3>"$SCRATCH/eager.mem"
    with_memory_peak "$PYTHON" "$ROOT/scripts/bench/reference_gpt.py" "${SHAPE[@]}" "${EXTRA[@]}" \
        --train-iters "$ITERS" --log-interval "$LOG_INTERVAL" >"$SCRATCH/eager.json"
    exec 3>&-
    cat "$SCRATCH/eager.json" >&2
    REFERENCES=("$SCRATCH/eager.json")
fi
if [[ "${REFERENCE:-eager}" != none && "${TORCH_COMPILE:-0}" == 1 ]]; then
    echo "== reference: torch.compile" >&2
    exec 3>"$SCRATCH/compile.mem"
    with_memory_peak "$PYTHON" "$ROOT/scripts/bench/reference_gpt.py" "${SHAPE[@]}" "${EXTRA[@]}" \
        --train-iters "$ITERS" --log-interval "$LOG_INTERVAL" --torch-compile >"$SCRATCH/compile.json"
    exec 3>&-
    REFERENCES+=("$SCRATCH/compile.json")
fi

"$PYTHON" "$ROOT/scripts/bench/training_table.py" "$SCRATCH" ${REFERENCES[@]+"${REFERENCES[@]}"}
