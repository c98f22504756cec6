#!/usr/bin/env bash
# Context parallelism on the GPUs of one node, launched by torchrun as a user would: for each
# --cp-comm-type, a model at a long sequence over CP=GPUS ranks, against the same model at
# SEQ / GPUS on one GPU (CP=1). Prints tokens/s, tokens/s per GPU, TFLOP/s per GPU, MFU, the
# peak memory the caching allocator reports (max allocated, MB, rank 0) and the per-GPU
# throughput as a share of the CP=1 baseline's. Every run: one micro-batch of one sequence per
# step, bf16, flash-friendly head size, mock data with a GPT-2-sized vocabulary.
#
# Environment (all optional):
#   PRETRAIN_GPT=path   the binary [default: target/release/pretrain_gpt, built here]
#   PYTHON=python3      a python with torch 2.11 (CUDA): libraries and torchrun
#   GPUS=4              context-parallel size [default: all that nvidia-smi lists]
#   MODELS="1.3b 7b"    which models
#   SEQ=32768           the long sequence
#   COMMS="p2p allgather a2a"  (a2a+p2p too: a2a within pairs of GPUs, p2p across them)
#   EXTRA_FLAGS=""      more pretrain_gpt flags for every run, e.g. packed sequences:
#                       "--reset-position-ids --reset-attention-mask --eod-mask-loss"
#   ITERS=20            iterations per run; the figures are those of the last log line
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
ITERS="${ITERS:-20}"
MODELS="${MODELS:-1.3b 7b}"
SEQ="${SEQ:-32768}"
COMMS="${COMMS:-p2p allgather a2a}"
if [[ -z "${PRETRAIN_GPT:-}" ]]; then
    (cd "$ROOT" && cargo build --release --quiet -p pretrain_gpt)
    PRETRAIN_GPT="${CARGO_TARGET_DIR:-$ROOT/target}/release/pretrain_gpt"
fi
# shellcheck source=../torch-env.sh
source "$ROOT/scripts/torch-env.sh" "$PYTHON"
GPUS="${GPUS:-$(nvidia-smi -L | wc -l)}"
SCRATCH="$(mktemp -d -t context-parallel-bench.XXXXXX)"
trap 'rm -rf "$SCRATCH"' EXIT

model_flags() {
    case "$1" in
        1.3b) echo "--num-layers 24 --hidden-size 2048 --num-attention-heads 16" ;;
        7b) echo "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008 \
--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear \
--untie-embeddings-and-output-weights" ;;
        *) echo "unknown model $1" >&2; exit 2 ;;
    esac
}

# run MODEL NPROC SEQ COMM: prints "tokens/s TFLOP/s/GPU MFU max-allocated-MB".
run() {
    local model="$1" nproc="$2" seq="$3" comm="$4"
    local log="$SCRATCH/$model-$nproc-$seq-$comm.log"
    local levels=""
    if [[ "$comm" == "a2a+p2p" ]]; then
        levels="--hierarchical-context-parallel-sizes 2 $((nproc / 2))"
    fi
    # shellcheck disable=SC2046
    "$PYTHON" -m torch.distributed.run --no-python --standalone --nproc-per-node "$nproc" \
        "$PRETRAIN_GPT" $(model_flags "$model") --seq-length "$seq" --max-position-embeddings "$seq" \
        --micro-batch-size 1 --global-batch-size 8 --train-iters "$ITERS" --lr 1e-4 --bf16 \
        --mock-data --tokenizer-type NullTokenizer --vocab-size 50256 --eval-iters 0 \
        --log-interval 10 --log-throughput --recompute-activations \
        --context-parallel-size "$nproc" --cp-comm-type "$comm" $levels ${EXTRA_FLAGS:-} \
        --use-distributed-optimizer >"$log" 2>&1 || {
        echo "run failed: $model, CP=$nproc, seq $seq, $comm; its errors:" >&2
        grep -v '^\s' "$log" | grep -i -m 10 'error' >&2 || tail -30 "$log" >&2
        echo "- - - -"
        return 0
    }
    local line tokens tflops mfu peak
    line="$(grep 'tokens per second' "$log" | tail -1)"
    tokens="$(sed -E 's/.*tokens per second: ([0-9]+).*/\1/' <<<"$line")"
    tflops="$(sed -E 's/.*\(TFLOP\/s\/GPU\): ([0-9.]+).*/\1/' <<<"$line")"
    mfu="$(sed -E 's/.*MFU: ([0-9.]+)%.*/\1/' <<<"$line")"
    peak="$(grep -m 1 'max allocated' "$log" | sed -E 's/.*max allocated: ([0-9.]+).*/\1/')"
    echo "$tokens $tflops $mfu $peak"
}

printf '%-5s %-10s %7s %5s %10s %13s %12s %7s %10s %9s\n' model comm seq GPUs tokens/s tokens/s/GPU TFLOP/s/GPU MFU peak-MB vs-CP=1
for model in $MODELS; do
    short=$((SEQ / GPUS))
    read -r tokens tflops mfu peak <<<"$(run "$model" 1 "$short" p2p)"
    base="$tokens"
    printf '%-5s %-10s %7s %5s %10s %13s %12s %6s%% %10s %9s\n' "$model" "CP=1" "$short" 1 "$tokens" "$tokens" "$tflops" "$mfu" "$peak" "100%"
    for comm in $COMMS; do
        read -r tokens tflops mfu peak <<<"$(run "$model" "$GPUS" "$SEQ" "$comm")"
        per_gpu="-"; share="-"
        if [[ "$tokens" != "-" ]]; then
            per_gpu=$((tokens / GPUS))
            share="$(awk -v a="$per_gpu" -v b="$base" 'BEGIN { printf "%.1f%%", 100 * a / b }')"
        fi
        printf '%-5s %-10s %7s %5s %10s %13s %12s %6s%% %10s %9s\n' "$model" "$comm" "$SEQ" "$GPUS" "$tokens" "$per_gpu" "$tflops" "$mfu" "$peak" "$share"
    done
done
