#!/usr/bin/env bash
# Training speed of our pretrain_bert against PyTorch references of the same model
# (scripts/bench/reference_bert.py: HuggingFace MegatronBertForPreTraining, eager and
# torch.compile, bf16 autocast, fused AdamW), one after the other on the same GPU: ms/iter,
# tokens/s, TFLOP/s, MFU and peak GPU memory (nvidia-smi, sampled every 100 ms), then the speed
# ratio.
#
# Default shape: BERT-345M (24 layers, hidden 1024, 16 heads, seq 512, binary head), micro batch
# 8, global batch 64, bf16, dropout 0.1, synthetic masked-LM data (--mock-data, BERT's 30522-token
# vocabulary padded to 30592).
#
# Environment (all optional):
#   PRETRAIN_BERT=path    the binary to time [default: target/release/pretrain_bert, built here]
#   PYTHON=python3        a python with torch 2.11 (CUDA) and transformers 5.23 for the references
#                         (transformers is pure Python: PYTHONPATH may point at a copy of it)
#   ITERS=30              iterations per run; ours reports the mean of the last log interval
#                         (10, or half the run below 20 iterations)
#   TORCH_COMPILE=1       0 leaves out the torch.compile reference row
#   OURS_VARIANTS=""      ;-separated flag sets for extra rows of ours (see ours_variants.sh)
#   EXTRA_FLAGS=""        more flags for every run (e.g. "--micro-batch-size 4")
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
ITERS="${ITERS:-30}"
if ! "$PYTHON" -c 'import torch, transformers' 2>/dev/null; then
    echo "pretrain_bert.sh: error: $PYTHON cannot import torch and transformers; the reference" \
        "needs both (pip install transformers==5.23.0, or PYTHONPATH=<a directory holding it>)" >&2
    exit 1
fi
if [[ -z "${PRETRAIN_BERT:-}" ]]; then
    (cd "$ROOT" && cargo build --release --quiet -p pretrain_bert)
    PRETRAIN_BERT="${CARGO_TARGET_DIR:-$ROOT/target}/release/pretrain_bert"
fi
# shellcheck source=../torch-env.sh
source "$ROOT/scripts/torch-env.sh" "$PYTHON"
SCRATCH="$(mktemp -d -t pretrain-bert-bench.XXXXXX)"
# shellcheck source=gpu_memory.sh
source "$ROOT/scripts/bench/gpu_memory.sh"
# shellcheck source=ours_variants.sh
source "$ROOT/scripts/bench/ours_variants.sh"
LOG_INTERVAL="$(log_interval "$ITERS")"
trap '[[ -n "$SAMPLER" ]] && kill "$SAMPLER" 2>/dev/null; rm -rf "$SCRATCH"' EXIT

SHAPE=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 512
       --max-position-embeddings 512 --micro-batch-size 8 --global-batch-size 64 --bf16)
# shellcheck disable=SC2206
EXTRA=(${EXTRA_FLAGS:-})

# NullTokenizer's --vocab-size n gives n + 1 tokens (end-of-document last): 30522 in all.
OURS=("$PRETRAIN_BERT" "${SHAPE[@]}" "${EXTRA[@]}" --lr 1e-4 --train-iters "$ITERS"
      --log-interval "$LOG_INTERVAL" --eval-interval 100000 --eval-iters 1 --mock-data
      --tokenizer-type NullTokenizer --vocab-size 30521 --log-throughput)

echo "== ours: $PRETRAIN_BERT" >&2
exec 3>"$SCRATCH/ours.mem"
with_memory_peak "${OURS[@]}" >"$SCRATCH/ours.log"
exec 3>&-
cat "$SCRATCH/ours.log" >&2
run_ours_variants "${OURS[@]}"

REFERENCES=()
for mode in eager compile; do
    [[ "$mode" == compile && "${TORCH_COMPILE:-1}" != 1 ]] && continue
    echo "== reference: HF MegatronBertForPreTraining, $mode" >&2
    flag=()
    [[ "$mode" == compile ]] && flag=(--torch-compile)
    exec 3>"$SCRATCH/$mode.mem"
    with_memory_peak "$PYTHON" "$ROOT/scripts/bench/reference_bert.py" "${SHAPE[@]}" "${EXTRA[@]}" \
        --train-iters "$ITERS" --log-interval "$LOG_INTERVAL" "${flag[@]}" >"$SCRATCH/$mode.json"
    exec 3>&-
    cat "$SCRATCH/$mode.json" >&2
    REFERENCES+=("$SCRATCH/$mode.json")
done

"$PYTHON" "$ROOT/scripts/bench/training_table.py" "$SCRATCH" "${REFERENCES[@]}"
