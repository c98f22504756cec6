#!/usr/bin/env bash
# Megatron's examples/pretrain_bert.sh: the 345M-parameter BERT on one GPU, with Megatron's flags.
# Make the data with sentence splitting (BERT's sentence-order head needs sentences):
#   preprocess_data --input wiki.jsonl --output-prefix my-bert --vocab-file bert-vocab.txt \
#       --tokenizer-type BertWordPieceLowerCase --split-sentences --workers 8
# then point the variables at it and run; torchrun is not needed on one GPU. Ctrl-C or SIGTERM
# saves a checkpoint and exits; rerunning resumes from it.
set -euo pipefail
BIN="${BIN:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target/release}"

CHECKPOINT_PATH="${CHECKPOINT_PATH:-checkpoints/bert_345m}"
VOCAB_FILE="${VOCAB_FILE:-bert-vocab.txt}"
DATA_PATH="${DATA_PATH:-my-bert_text_sentence}"
TENSORBOARD_DIR="${TENSORBOARD_DIR:-$CHECKPOINT_PATH/tensorboard}"

BERT_ARGS=(
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16
    --seq-length 512 --max-position-embeddings 512
    --micro-batch-size 4 --global-batch-size 32
    --lr 0.0001 --train-iters 1000000 --lr-decay-iters 990000 --lr-decay-style linear
    --min-lr 1.0e-5 --weight-decay 1e-2 --lr-warmup-fraction .01 --clip-grad 1.0 --bf16
)
DATA_ARGS=(
    --data-path "$DATA_PATH" --vocab-file "$VOCAB_FILE" --tokenizer-type BertWordPieceLowerCase
    --split 949,50,1
)
OUTPUT_ARGS=(
    --log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10
    --tensorboard-dir "$TENSORBOARD_DIR" --log-throughput
)

exec "$BIN/pretrain_bert" "${BERT_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" \
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" "$@"
