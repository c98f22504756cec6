#!/usr/bin/env bash
# Scaling of pretrain_gpt over the GPUs of one node, launched by torchrun exactly as a user
# would (`torchrun --no-python --nproc-per-node N pretrain_gpt ...`, NCCL backend): for each
# model and layout, tokens/s, tokens/s per GPU, TFLOP/s per GPU and MFU, against the 1-GPU run
# of the same model. Weak scaling: every data-parallel rank runs 8 micro-batches of 4 per step,
# so the global batch grows with the data-parallel size.
#
# Layouts: with 2 GPUs DP=2, TP=2, PP=2; with 4 GPUs DP=4, TP=2×DP=2, TP=4, PP=2×DP=2; with 8
# GPUs DP=8, TP=2×DP=4, TP=4×DP=2, TP=8, PP=2×DP=4, TP=2×PP=2×DP=2, PP=4×DP=2.
# Models: GPT 345M (24 layers, hidden 1024, 16 heads) and 1.3B (24 layers, hidden 2048, 16
# heads), seq 1024, bf16, mock data with a GPT-2-sized vocabulary.
#
# Environment (all optional):
#   PRETRAIN_GPT=path   the binary [default: target/release/pretrain_gpt, built here]
#   PYTHON=python3      a python with torch 2.11 (CUDA): libraries and torchrun
#   GPUS=N              GPUs to use [default: all that nvidia-smi lists]
#   MODELS="345m 1.3b"  which models
#   ITERS=20            iterations per run; the figures are the mean of the last 10
#   OVERLAP=1           --overlap-grad-reduce --overlap-param-gather; `grad` only the first;
#                       0 neither (gradients reduced after backward, parameters gathered
#                       after the step)
#   LAYOUTS_ONLY="1 1;1 1 dp" only these layouts ("TP PP", "1 1 dp" = data parallel on all GPUs)
#   EXTRA_FLAGS="..."   flags added to every run, e.g. "--enable-cuda-graph
#                       --cross-entropy-loss-fusion"; `--sequence-parallel` is added to the
#                       runs with TP > 1 when SP=1
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
ITERS="${ITERS:-20}"
MODELS="${MODELS:-345m 1.3b}"
case "${OVERLAP:-1}" in
    1) OVERLAP_FLAG=(--overlap-grad-reduce --overlap-param-gather) ;;
    grad) OVERLAP_FLAG=(--overlap-grad-reduce) ;;
    0) OVERLAP_FLAG=() ;;
    *) echo "scaling.sh: OVERLAP must be 1, grad or 0" >&2; exit 2 ;;
esac
if [[ -z "${PRETRAIN_GPT:-}" ]]; then
    (cd "$ROOT" && cargo build --release --quiet -p pretrain_gpt)
    PRETRAIN_GPT="${CARGO_TARGET_DIR:-$ROOT/target}/release/pretrain_gpt"
fi
# shellcheck source=../torch-env.sh
source "$ROOT/scripts/torch-env.sh" "$PYTHON"
GPUS="${GPUS:-$(nvidia-smi -L | wc -l)}"
SCRATCH="$(mktemp -d -t scaling-bench.XXXXXX)"
trap 'rm -rf "$SCRATCH"' EXIT

case "$GPUS" in
    2) LAYOUTS=("1 1" "1 1 dp" "2 1" "1 2") ;;
    4) LAYOUTS=("1 1" "1 1 dp" "2 1" "4 1" "1 2") ;;
    8) LAYOUTS=("1 1" "1 1 dp" "2 1" "4 1" "8 1" "1 2" "2 2" "1 4") ;;
    *) echo "scaling.sh: needs 2, 4 or 8 GPUs, found $GPUS" >&2; exit 2 ;;
esac
if [[ -n "${LAYOUTS_ONLY:-}" ]]; then
    IFS=';' read -r -a LAYOUTS <<<"$LAYOUTS_ONLY"
fi

model_flags() {
    case "$1" in
        345m) echo "--num-layers 24 --hidden-size 1024 --num-attention-heads 16" ;;
        1.3b) echo "--num-layers 24 --hidden-size 2048 --num-attention-heads 16" ;;
        *) echo "unknown model $1" >&2; exit 2 ;;
    esac
}

# run MODEL NPROC TP PP: prints "tokens/s TFLOP/s/GPU MFU" of the last log line.
run() {
    local model="$1" nproc="$2" tp="$3" pp="$4"
    local dp=$((nproc / (tp * pp)))
    local sp=()
    [[ "${SP:-0}" == 1 && "$tp" -gt 1 ]] && sp=(--sequence-parallel)
    local log="$SCRATCH/$model-$nproc-$tp-$pp.log"
    # shellcheck disable=SC2046,SC2086
    "$PYTHON" -m torch.distributed.run --no-python --standalone --nproc-per-node "$nproc" \
        "$PRETRAIN_GPT" $(model_flags "$model") --seq-length 1024 --max-position-embeddings 1024 \
        --micro-batch-size 4 --global-batch-size $((32 * dp)) --train-iters "$ITERS" --lr 1e-4 --bf16 \
        --mock-data --tokenizer-type NullTokenizer --vocab-size 50256 --eval-iters 0 \
        --log-interval 10 --log-throughput \
        --tensor-model-parallel-size "$tp" --pipeline-model-parallel-size "$pp" \
        --use-distributed-optimizer "${OVERLAP_FLAG[@]}" "${sp[@]}" ${EXTRA_FLAGS:-} >"$log" 2>&1 || {
        echo "run failed: $model on $nproc GPU(s), TP=$tp PP=$pp; its errors:" >&2
        grep -v '^\s' "$log" | grep -i -m 10 'error' >&2 || tail -30 "$log" >&2
        return 1
    }
    local line
    line="$(grep 'tokens per second' "$log" | tail -1)"
    local tokens tflops mfu
    tokens="$(sed -E 's/.*tokens per second: ([0-9]+).*/\1/' <<<"$line")"
    tflops="$(sed -E 's/.*\(TFLOP\/s\/GPU\): ([0-9.]+).*/\1/' <<<"$line")"
    mfu="$(sed -E 's/.*MFU: ([0-9.]+)%.*/\1/' <<<"$line")"
    echo "$tokens $tflops $mfu"
}

printf '%-6s %-18s %5s %12s %14s %12s %7s %11s\n' model layout GPUs tokens/s tokens/s/GPU TFLOP/s/GPU MFU efficiency
for model in $MODELS; do
    base_per_gpu=""
    for layout in "${LAYOUTS[@]}"; do
        read -r tp pp kind <<<"$layout"
        if [[ "$tp $pp" == "1 1" && -z "${kind:-}" ]]; then
            nproc=1
        else
            nproc="$GPUS"
        fi
        dp=$((nproc / (tp * pp)))
        read -r tokens tflops mfu <<<"$(run "$model" "$nproc" "$tp" "$pp")"
        per_gpu=$((tokens / nproc))
        [[ -z "$base_per_gpu" ]] && base_per_gpu="$per_gpu"
        efficiency="$(awk -v a="$per_gpu" -v b="$base_per_gpu" 'BEGIN { printf "%.1f%%", 100 * a / b }')"
        name="TP=$tp PP=$pp DP=$dp"
        printf '%-6s %-18s %5s %12s %14s %12s %6s%% %11s\n' "$model" "$name" "$nproc" "$tokens" "$per_gpu" "$tflops" "$mfu" "$efficiency"
    done
done
