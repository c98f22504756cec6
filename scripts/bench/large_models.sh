#!/usr/bin/env bash
# Large GPT shapes on the GPUs of one node (issue 35, point 6): the Llama-2-7B shape (32×4096,
# SwiGLU 11008, RMSNorm, RoPE, untied, no bias) and a 13B shape (40×5120, SwiGLU 13824), seq
# 2048, bf16, launched by torchrun as a user would. For each layout: tokens/s, TFLOP/s per GPU,
# MFU (against the card's dense bf16 peak, as pretrain_gpt's log line reports it), the predicted
# and the measured peak memory of the busiest rank. Layouts are tried in order; one that fails
# (out of memory, say) prints its first error and the next is run.
#
# Environment (all optional):
#   PRETRAIN_GPT=path   the binary [default: target/release/pretrain_gpt, built here]
#   PYTHON=python3      a python with torch 2.11 (CUDA): libraries and torchrun
#   GPUS=4              GPUs to use [default: all that nvidia-smi lists]
#   MODELS="7b 13b"     which shapes
#   ITERS=12            iterations per run; the figures are those of the last log line
#                       (the mean of its log interval, 5 iterations)
#   GLOBAL=32           global batch in sequences
#   LAYOUTS="MBS|name|flags;..."   the layouts to run [default below]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
ITERS="${ITERS:-12}"
GLOBAL="${GLOBAL:-32}"
MODELS="${MODELS:-7b 13b}"
if [[ -z "${PRETRAIN_GPT:-}" ]]; then
    (cd "$ROOT" && cargo build --release --quiet -p pretrain_gpt)
    PRETRAIN_GPT="${CARGO_TARGET_DIR:-$ROOT/target}/release/pretrain_gpt"
fi
# shellcheck source=../torch-env.sh
source "$ROOT/scripts/torch-env.sh" "$PYTHON"
GPUS="${GPUS:-$(nvidia-smi -L | wc -l)}"
SCRATCH="$(mktemp -d -t large-models.XXXXXX)"
trap 'rm -rf "$SCRATCH"' EXIT

SP="--sequence-parallel"
GRAPHS="--enable-cuda-graph"
DISTOPT="--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
DEFAULT_LAYOUTS="2|TP=4 + SP|--tensor-model-parallel-size 4 $SP"
DEFAULT_LAYOUTS+=";2|TP=4 + SP, CUDA graphs|--tensor-model-parallel-size 4 $SP $GRAPHS"
DEFAULT_LAYOUTS+=";2|TP=2 + SP × PP=2|--tensor-model-parallel-size 2 $SP --pipeline-model-parallel-size 2"
DEFAULT_LAYOUTS+=";2|TP=2 + SP × DP=2, distributed optimizer|--tensor-model-parallel-size 2 $SP $DISTOPT"
DEFAULT_LAYOUTS+=";2|TP=2 + SP × DP=2, distopt, CUDA graphs|--tensor-model-parallel-size 2 $SP $DISTOPT $GRAPHS"
DEFAULT_LAYOUTS+=";2|PP=2 × DP=2, distributed optimizer|--pipeline-model-parallel-size 2 $DISTOPT"
DEFAULT_LAYOUTS+=";2|DP=4, distributed optimizer|$DISTOPT"
DEFAULT_LAYOUTS+=";2|DP=4, distributed optimizer, CUDA graphs|$DISTOPT $GRAPHS"
IFS=';' read -r -a LAYOUTS <<<"${LAYOUTS:-$DEFAULT_LAYOUTS}"

model_flags() {
    local common="--swiglu --normalization RMSNorm --position-embedding-type rope
        --untie-embeddings-and-output-weights --disable-bias-linear"
    case "$1" in
        7b) echo "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008 $common" ;;
        13b) echo "--num-layers 40 --hidden-size 5120 --num-attention-heads 40 --ffn-hidden-size 13824 $common" ;;
        *) echo "large_models.sh: MODELS takes 7b and 13b, not $1" >&2; exit 2 ;;
    esac
}

printf '%-5s %-42s %11s %12s %7s %13s %13s\n' model layout tokens/s TFLOP/s/GPU MFU "predicted" "peak memory"
for model in $MODELS; do
    for entry in "${LAYOUTS[@]}"; do
        IFS='|' read -r mbs name flags <<<"$entry"
        log="$SCRATCH/run.log"
        # shellcheck disable=SC2046,SC2086
        "$PYTHON" -m torch.distributed.run --no-python --standalone --nproc-per-node "$GPUS" \
            "$PRETRAIN_GPT" $(model_flags "$model") --seq-length 2048 --max-position-embeddings 2048 \
            --micro-batch-size "$mbs" --global-batch-size "$GLOBAL" --train-iters "$ITERS" \
            --lr 1e-4 --bf16 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 \
            --eval-iters 0 --log-interval 5 --log-throughput $flags >"$log" 2>&1 || {
            printf '%-5s %-42s failed: %s\n' "$model" "$name, mbs $mbs" \
                "$(grep -m1 -iE '^error|out of memory' "$log" || tail -1 "$log")"
            continue
        }
        line="$(grep 'tokens per second' "$log" | tail -1)"
        tokens="$(sed -E 's/.*tokens per second: ([0-9]+).*/\1/' <<<"$line")"
        tflops="$(sed -E 's/.*\(TFLOP\/s\/GPU\): ([0-9.]+).*/\1/' <<<"$line")"
        mfu="$(sed -E 's/.*MFU: ([0-9.]+)%.*/\1/' <<<"$line")"
        predicted="$(grep -m1 'Theoretical memory footprints' "$log" | sed -E 's/.*total=([0-9.]+) MB.*/\1/')"
        measured="$(grep -E '^\[Rank [0-9]+\] \(after [0-9]+ iterations\)' "$log" \
            | sed -E 's/.*max allocated: ([0-9.]+).*/\1/' | sort -g | tail -1)"
        printf '%-5s %-42s %11s %12s %6s%% %10.0f MB %10.0f MB\n' "$model" "$name, mbs $mbs" \
            "$tokens" "$tflops" "$mfu" "$predicted" "$measured"
    done
done
