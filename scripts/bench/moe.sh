#!/usr/bin/env bash
# Mixture-of-Experts training speed on one GPU (issue 37, point 7): our pretrain_gpt on a
# Mixtral-shaped small MoE against a PyTorch reference of the same model
# (scripts/bench/reference_moe.py: grouped GEMM experts through torch._grouped_mm, fused AdamW,
# bf16 autocast), eager and torch.compile, one after the other on the same GPU: ms/iter,
# tokens/s, TFLOP/s and MFU over active parameters (Megatron's formula for every row), peak GPU
# memory (nvidia-smi, sampled every 100 ms), then the speed ratio.
#
# Default shape: 8 layers, hidden 1024, 16 heads, RMSNorm, RoPE, SwiGLU experts of width 2816,
# 8 experts top-2, load-balancing loss 1e-2, seq 2048, micro batch 4, global batch 32, bf16,
# vocabulary 32000, mock data.
#
# Environment (all optional):
#   PRETRAIN_GPT=path   the binary [default: target/release/pretrain_gpt, built here]
#   PYTHON=python3      a python with torch 2.11 (CUDA)
#   ITERS=30            iterations per run (ours reports the mean of its last log interval)
#   LAYERS=8 HIDDEN=1024 HEADS=16 FFN=2816 EXPERTS=8 TOPK=2 SEQ=2048 MICRO=4 GLOBAL=32
#   OURS_VARIANTS="--moe-grouped-gemm --moe-permute-fusion;--moe-grouped-gemm --moe-permute-fusion --no-cuda-graph"
#                       ;-separated flag sets for extra rows of ours; the default adds the rows of
#                       the experts as grouped GEMMs (whose micro-batches replay from CUDA graphs
#                       by default) and the same without graphs, beside the first row's per-expert
#                       loop (eager: its batch sizes come through the host); OURS_VARIANTS= leaves
#                       them out
#   REFERENCE_EXPERTS=grouped   grouped or loop: how the reference runs its experts
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
SCRATCH="$(mktemp -d -t moe-bench.XXXXXX)"
# shellcheck source=gpu_memory.sh
source "$ROOT/scripts/bench/gpu_memory.sh"
# shellcheck source=ours_variants.sh
source "$ROOT/scripts/bench/ours_variants.sh"
LOG_INTERVAL="$(log_interval "$ITERS")"
GROUPED="--moe-grouped-gemm --moe-permute-fusion"
OURS_VARIANTS="${OURS_VARIANTS-$GROUPED;$GROUPED --no-cuda-graph}"
trap '[[ -n "$SAMPLER" ]] && kill "$SAMPLER" 2>/dev/null; rm -rf "$SCRATCH"' EXIT

LAYERS="${LAYERS:-8}" HIDDEN="${HIDDEN:-1024}" HEADS="${HEADS:-16}" FFN="${FFN:-2816}"
EXPERTS="${EXPERTS:-8}" TOPK="${TOPK:-2}" SEQ="${SEQ:-2048}" MICRO="${MICRO:-4}" GLOBAL="${GLOBAL:-32}"
SHAPE=(--num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS"
       --moe-ffn-hidden-size "$FFN" --num-experts "$EXPERTS" --moe-router-topk "$TOPK"
       --moe-aux-loss-coeff 1e-2 --seq-length "$SEQ" --micro-batch-size "$MICRO"
       --global-batch-size "$GLOBAL")

OURS=("$PRETRAIN_GPT" "${SHAPE[@]}" --ffn-hidden-size "$FFN" --max-position-embeddings "$SEQ"
      --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear
      --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 --bf16
      --lr 1e-4 --train-iters "$ITERS" --log-interval "$LOG_INTERVAL" --eval-iters 0
      --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --log-throughput)

echo "== ours: $PRETRAIN_GPT" >&2
exec 3>"$SCRATCH/ours.mem"
with_memory_peak "${OURS[@]}" >"$SCRATCH/ours.log"
exec 3>&-
cat "$SCRATCH/ours.log" >&2
run_ours_variants "${OURS[@]}"

REFERENCE=("$PYTHON" "$ROOT/scripts/bench/reference_moe.py" "${SHAPE[@]}" --vocab-size 32000
           --train-iters "$ITERS" --log-interval "$LOG_INTERVAL"
           --experts-impl "${REFERENCE_EXPERTS:-grouped}")
REFERENCES=()
for kind in eager compile; do
    echo "== reference: PyTorch $kind" >&2
    flags=()
    [[ "$kind" == compile ]] && flags=(--torch-compile)
    exec 3>"$SCRATCH/$kind.mem"
    if with_memory_peak "${REFERENCE[@]}" "${flags[@]}" >"$SCRATCH/$kind.json"; then
        REFERENCES+=("$SCRATCH/$kind.json")
    else
        echo "reference ($kind) failed; left out of the table" >&2
    fi
    exec 3>&-
done

"$PYTHON" "$ROOT/scripts/bench/training_table.py" "$SCRATCH" ${REFERENCES[@]+"${REFERENCES[@]}"}
