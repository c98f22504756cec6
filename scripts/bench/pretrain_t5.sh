#!/usr/bin/env bash
# Training speed of our pretrain_t5 against a PyTorch reference of the same model
# (scripts/bench/reference_t5.py: Megatron core's T5 written from the spec as a plain PyTorch
# module with SDPA attention, eager and torch.compile, bf16 autocast, fused AdamW), one after the
# other on the same GPU: ms/iter, tokens/s (encoder tokens), TFLOP/s, MFU and peak GPU memory
# (nvidia-smi, sampled every 100 ms), then the speed ratio.
#
# Default shape: T5-220M (12 + 12 layers, hidden 768, 12 heads, kv-channels 64, ffn 3072,
# encoder 512 / decoder 128 tokens), micro batch 16, global batch 128, bf16, dropout 0.1,
# synthetic span-corruption data (--mock-data, a 30622-token vocabulary — BERT's 30522 plus 100
# sentinels — padded to 30720).
#
# Environment (all optional):
#   PRETRAIN_T5=path      the binary to time [default: target/release/pretrain_t5, built here]
#   PYTHON=python3        a python with torch 2.11 (CUDA) for the references
#   ITERS=30              iterations per run; ours reports the mean of the last log interval
#                         (10, or half the run below 20 iterations)
#   TORCH_COMPILE=1       0 leaves out the torch.compile reference row
#   OURS_VARIANTS=""      ;-separated flag sets for extra rows of ours (see ours_variants.sh)
#   EXTRA_FLAGS=""        more flags for every run (e.g. "--micro-batch-size 8")
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
ITERS="${ITERS:-30}"
if ! "$PYTHON" -c 'import torch' 2>/dev/null; then
    echo "pretrain_t5.sh: error: $PYTHON cannot import torch, which the reference needs" >&2
    exit 1
fi
if [[ -z "${PRETRAIN_T5:-}" ]]; then
    (cd "$ROOT" && cargo build --release --quiet -p pretrain_t5)
    PRETRAIN_T5="${CARGO_TARGET_DIR:-$ROOT/target}/release/pretrain_t5"
fi
# shellcheck source=../torch-env.sh
source "$ROOT/scripts/torch-env.sh" "$PYTHON"
SCRATCH="$(mktemp -d -t pretrain-t5-bench.XXXXXX)"
# shellcheck source=gpu_memory.sh
source "$ROOT/scripts/bench/gpu_memory.sh"
# shellcheck source=ours_variants.sh
source "$ROOT/scripts/bench/ours_variants.sh"
LOG_INTERVAL="$(log_interval "$ITERS")"
trap '[[ -n "$SAMPLER" ]] && kill "$SAMPLER" 2>/dev/null; rm -rf "$SCRATCH"' EXIT

SHAPE=(--encoder-num-layers 12 --decoder-num-layers 12 --hidden-size 768 --num-attention-heads 12
       --kv-channels 64 --ffn-hidden-size 3072 --encoder-seq-length 512 --decoder-seq-length 128
       --max-position-embeddings 512 --micro-batch-size 16 --global-batch-size 128 --bf16)
# shellcheck disable=SC2206
EXTRA=(${EXTRA_FLAGS:-})

# NullTokenizer's --vocab-size n gives n + 1 tokens (end-of-document last): 30622 in all.
OURS=("$PRETRAIN_T5" "${SHAPE[@]}" "${EXTRA[@]}" --lr 1e-4 --train-iters "$ITERS"
      --log-interval "$LOG_INTERVAL" --eval-interval 100000 --eval-iters 1 --mock-data
      --tokenizer-type NullTokenizer --vocab-size 30621 --log-throughput)

echo "== ours: $PRETRAIN_T5" >&2
exec 3>"$SCRATCH/ours.mem"
with_memory_peak "${OURS[@]}" >"$SCRATCH/ours.log"
exec 3>&-
cat "$SCRATCH/ours.log" >&2
run_ours_variants "${OURS[@]}"

REFERENCES=()
for mode in eager compile; do
    [[ "$mode" == compile && "${TORCH_COMPILE:-1}" != 1 ]] && continue
    echo "== reference: spec T5 in PyTorch, $mode" >&2
    flag=()
    [[ "$mode" == compile ]] && flag=(--torch-compile)
    exec 3>"$SCRATCH/$mode.mem"
    with_memory_peak "$PYTHON" "$ROOT/scripts/bench/reference_t5.py" "${SHAPE[@]}" "${EXTRA[@]}" \
        --vocab-size 30622 --train-iters "$ITERS" --log-interval "$LOG_INTERVAL" "${flag[@]}" >"$SCRATCH/$mode.json"
    exec 3>&-
    cat "$SCRATCH/$mode.json" >&2
    REFERENCES+=("$SCRATCH/$mode.json")
done

"$PYTHON" "$ROOT/scripts/bench/training_table.py" "$SCRATCH" "${REFERENCES[@]}"
