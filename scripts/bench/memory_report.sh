#!/usr/bin/env bash
# The theoretical memory report against the CUDA allocator's measured peak: for each layout,
# pretrain_gpt prints before training "Theoretical memory footprints: weight and optimizer=...,
# activation=..., total=... MB" (the largest rank's prediction) and after the first iteration
# every rank of the first data-parallel replica prints Megatron's "[Rank r] (after 1
# iterations) memory (MB) | ... | max allocated: X"; the table puts the prediction beside the
# largest "max allocated" and gives their ratio. The activation formula (docs/parallelism.md)
# is calibrated from these rows.
#
# Environment (all optional):
#   PRETRAIN_GPT=path   the binary [default: target/release/pretrain_gpt, built here]
#   PYTHON=python3      a python with torch 2.11 (CUDA): libraries and torchrun
#   GPUS=N              GPUs to use [default: all that nvidia-smi lists; layouts needing more
#                       are left out]
#   MODEL="1.3b"        345m, 1.3b or 7b (the Llama-2-7B shape: SwiGLU, RMSNorm, RoPE, untied)
#   SEQ=1024 MBS=4      sequence length and micro-batch size
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
MODEL="${MODEL:-1.3b}"
SEQ="${SEQ:-1024}"
MBS="${MBS:-4}"
if [[ -z "${PRETRAIN_GPT:-}" ]]; then
    (cd "$ROOT" && cargo build --release --quiet -p pretrain_gpt)
    PRETRAIN_GPT="${CARGO_TARGET_DIR:-$ROOT/target}/release/pretrain_gpt"
fi
# shellcheck source=../torch-env.sh
source "$ROOT/scripts/torch-env.sh" "$PYTHON"
GPUS="${GPUS:-$(nvidia-smi -L | wc -l)}"
SCRATCH="$(mktemp -d -t memory-report.XXXXXX)"
trap 'rm -rf "$SCRATCH"' EXIT

case "$MODEL" in
    345m) MODEL_FLAGS=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16) ;;
    1.3b) MODEL_FLAGS=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16) ;;
    7b) MODEL_FLAGS=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32
            --ffn-hidden-size 11008 --swiglu --normalization RMSNorm
            --position-embedding-type rope --untie-embeddings-and-output-weights
            --disable-bias-linear) ;;
    *) echo "memory_report.sh: MODEL must be 345m, 1.3b or 7b" >&2; exit 2 ;;
esac

# "GPUS|name|flags": the layouts, each run on its number of GPUs.
LAYOUTS=(
    "1|1 GPU|"
    "1|1 GPU, full recompute|--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
    "2|TP=2|--tensor-model-parallel-size 2"
    "2|TP=2 + SP|--tensor-model-parallel-size 2 --sequence-parallel"
    "2|DP=2, distributed optimizer|--use-distributed-optimizer"
    "2|PP=2, 8 micro-batches|--pipeline-model-parallel-size 2"
    "4|TP=4 + SP|--tensor-model-parallel-size 4 --sequence-parallel"
    "4|TP=2 + SP × PP=2|--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2"
    "4|PP=2 × DP=2, distributed optimizer|--pipeline-model-parallel-size 2 --use-distributed-optimizer"
    "4|PP=4, 8 micro-batches|--pipeline-model-parallel-size 4"
    "4|DP=4, distributed optimizer|--use-distributed-optimizer"
)

printf '%-40s %5s %13s %13s %13s %13s\n' layout GPUs "weights+opt" activations predicted measured
for entry in "${LAYOUTS[@]}"; do
    IFS='|' read -r nproc name flags <<<"$entry"
    (( nproc <= GPUS )) || continue
    log="$SCRATCH/run.log"
    # The global batch is 8 micro-batches per GPU: 8 per data-parallel rank and step at least.
    # shellcheck disable=SC2086
    "$PYTHON" -m torch.distributed.run --no-python --standalone --nproc-per-node "$nproc" \
        "$PRETRAIN_GPT" "${MODEL_FLAGS[@]}" --seq-length "$SEQ" --max-position-embeddings "$SEQ" \
        --micro-batch-size "$MBS" --global-batch-size $((8 * MBS * nproc)) --train-iters 2 \
        --lr 1e-4 --bf16 --mock-data --tokenizer-type NullTokenizer --vocab-size 50256 \
        --eval-iters 0 --log-interval 1 $flags >"$log" 2>&1 || {
        echo "run failed: $name; its errors:" >&2
        grep -m 5 '^error' "$log" >&2 || tail -20 "$log" >&2
        continue
    }
    predicted="$(grep -m1 'Theoretical memory footprints' "$log")"
    state="$(sed -E 's/.*weight and optimizer=([0-9.]+) MB.*/\1/' <<<"$predicted")"
    activations="$(sed -E 's/.*activation=([0-9.]+) MB.*/\1/' <<<"$predicted")"
    total="$(sed -E 's/.*total=([0-9.]+) MB.*/\1/' <<<"$predicted")"
    measured="$(grep -E '^\[Rank [0-9]+\] \(after 1 iterations\)' "$log" \
        | sed -E 's/.*max allocated: ([0-9.]+).*/\1/' | sort -g | tail -1)"
    ratio="$(awk -v p="$total" -v m="$measured" 'BEGIN { printf "%.3f", p / m }')"
    printf '%-40s %5s %10.0f MB %10.0f MB %10.0f MB %10.0f MB  predicted/measured %s\n' \
        "$name" "$nproc" "$state" "$activations" "$total" "$measured" "$ratio"
done
