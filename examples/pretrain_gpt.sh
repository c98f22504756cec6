#!/usr/bin/env bash
# Megatron's examples/pretrain_gpt.sh: the 345M-parameter GPT on one GPU, with Megatron's flags.
# Point the variables at your data (made by preprocess_data) and run; torchrun is not needed on
# one GPU. Ctrl-C or SIGTERM saves a checkpoint and exits; rerunning resumes from it.
set -euo pipefail
BIN="${BIN:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target/release}"

CHECKPOINT_PATH="${CHECKPOINT_PATH:-checkpoints/gpt2_345m}"
VOCAB_FILE="${VOCAB_FILE:-gpt2-vocab.json}"
MERGE_FILE="${MERGE_FILE:-gpt2-merges.txt}"
DATA_PATH="${DATA_PATH:-my-gpt2_text_document}"
TENSORBOARD_DIR="${TENSORBOARD_DIR:-$CHECKPOINT_PATH/tensorboard}"

GPT_ARGS=(
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16
    --seq-length 1024 --max-position-embeddings 1024
    --micro-batch-size 8 --global-batch-size 64
    --lr 0.00015 --train-iters 500000 --lr-decay-iters 320000 --lr-decay-style cosine
    --min-lr 1.0e-5 --weight-decay 1e-2 --lr-warmup-fraction .01 --clip-grad 1.0 --bf16
)
DATA_ARGS=(
    --data-path "$DATA_PATH" --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" --split 949,50,1
)
OUTPUT_ARGS=(
    --log-interval 10 --save-interval 1000 --eval-interval 100 --eval-iters 10
    --tensorboard-dir "$TENSORBOARD_DIR" --log-throughput
)

exec "$BIN/pretrain_gpt" "${GPT_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" \
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" "$@"
