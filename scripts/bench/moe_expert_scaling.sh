#!/usr/bin/env bash
# Weak scaling of expert parallelism: a Mixtral-shaped small MoE (8 layers, hidden 1024, 16
# heads, SwiGLU, RMSNorm, RoPE, 8 experts top-2 of width 2816, seq 2048, bf16, mock data) on one
# GPU, then on N GPUs with --expert-model-parallel-size N (each GPU holds 8/N experts, every
# GPU its own micro-batches: 8 of 4 per step), launched by torchrun as a user would. Prints
# tokens/s, tokens/s per GPU, TFLOP/s per GPU, MFU over the active parameters, and the
# efficiency per GPU against one GPU (issue 37 asks for ≥ 85% at EP=4).
#
# Environment (all optional):
#   PRETRAIN_GPT=path   the binary [default: target/release/pretrain_gpt, built here]
#   PYTHON=python3      a python with torch 2.11 (CUDA): libraries and torchrun
#   GPUS=N              GPUs for the expert-parallel run [default: all that nvidia-smi lists]
#   DISPATCHER=alltoall --moe-token-dispatcher-type (alltoall or allgather)
#   ITERS=20            iterations per run; the figures are from the last log line
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
ITERS="${ITERS:-20}"
DISPATCHER="${DISPATCHER:-alltoall}"
if [[ -z "${PRETRAIN_GPT:-}" ]]; then
    (cd "$ROOT" && cargo build --release --quiet -p pretrain_gpt)
    PRETRAIN_GPT="${CARGO_TARGET_DIR:-$ROOT/target}/release/pretrain_gpt"
fi
# shellcheck source=../torch-env.sh
source "$ROOT/scripts/torch-env.sh" "$PYTHON"
GPUS="${GPUS:-$(nvidia-smi -L | wc -l)}"
SCRATCH="$(mktemp -d -t moe-scaling.XXXXXX)"
trap 'rm -rf "$SCRATCH"' EXIT

# run NPROC: prints "tokens/s TFLOP/s/GPU MFU" of the last log line.
run() {
    local nproc="$1"
    local log="$SCRATCH/$nproc.log"
    "$PYTHON" -m torch.distributed.run --no-python --standalone --nproc-per-node "$nproc" \
        "$PRETRAIN_GPT" --num-layers 8 --hidden-size 1024 --num-attention-heads 16 \
        --ffn-hidden-size 2816 --swiglu --normalization RMSNorm --position-embedding-type rope \
        --disable-bias-linear --untie-embeddings-and-output-weights \
        --num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 \
        --moe-token-dispatcher-type "$DISPATCHER" --expert-model-parallel-size "$nproc" \
        --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4 \
        --global-batch-size $((32 * nproc)) --train-iters "$ITERS" --lr 1e-4 --bf16 \
        --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --eval-iters 0 \
        --log-interval 10 --log-throughput --use-distributed-optimizer >"$log" 2>&1 || {
        echo "run failed on $nproc GPU(s); its last lines:" >&2
        tail -30 "$log" >&2
        return 1
    }
    local line
    line="$(grep 'tokens per second' "$log" | tail -1)"
    echo "$(sed -E 's/.*tokens per second: ([0-9]+).*/\1/' <<<"$line")" \
        "$(sed -E 's/.*\(TFLOP\/s\/GPU\): ([0-9.]+).*/\1/' <<<"$line")" \
        "$(sed -E 's/.*MFU: ([0-9.]+)%.*/\1/' <<<"$line")"
}

printf '%-8s %5s %12s %14s %12s %7s %11s\n' layout GPUs tokens/s tokens/s/GPU TFLOP/s/GPU MFU efficiency
base=""
for nproc in 1 "$GPUS"; do
    read -r tokens tflops mfu <<<"$(run "$nproc")"
    per_gpu=$((tokens / nproc))
    [[ -z "$base" ]] && base="$per_gpu"
    efficiency="$(awk -v a="$per_gpu" -v b="$base" 'BEGIN { printf "%.1f%%", 100 * a / b }')"
    printf '%-8s %5s %12s %14s %12s %6s%% %11s\n' "EP=$nproc" "$nproc" "$tokens" "$per_gpu" "$tflops" "$mfu" "$efficiency"
done
