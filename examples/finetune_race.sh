#!/usr/bin/env bash
# Megatron's RACE finetuning example (tasks/main.py --task RACE) with our binary: the 345M BERT of
# examples/pretrain_bert.sh, three epochs over RACE's middle- and high-school questions, the
# accuracy on both dev sets after every epoch. Point the variables at the RACE directory, the
# vocabulary and a pretrain_bert checkpoint.
set -euo pipefail
BIN="${BIN:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target/release}"

RACE_DIR="${RACE_DIR:-RACE}"
VOCAB_FILE="${VOCAB_FILE:-bert-vocab.txt}"
PRETRAINED_CHECKPOINT="${PRETRAINED_CHECKPOINT:-checkpoints/bert_345m}"
CHECKPOINT_PATH="${CHECKPOINT_PATH:-checkpoints/bert_345m_race}"

exec "$BIN/eval_tasks" --task RACE --seed 1234 \
    --train-data "$RACE_DIR/train/middle" "$RACE_DIR/train/high" \
    --valid-data "$RACE_DIR/dev/middle" "$RACE_DIR/dev/high" \
    --tokenizer-type BertWordPieceLowerCase --vocab-file "$VOCAB_FILE" \
    --epochs 3 --pretrained-checkpoint "$PRETRAINED_CHECKPOINT" \
    --tensor-model-parallel-size 1 \
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
    --micro-batch-size 4 --lr 1.0e-5 --lr-warmup-fraction 0.06 \
    --seq-length 512 --max-position-embeddings 512 \
    --save-interval 100000 --save "$CHECKPOINT_PATH" \
    --log-interval 10 --eval-interval 100 --eval-iters 50 \
    --weight-decay 1.0e-1 --clip-grad 1.0 --hidden-dropout 0.1 --attention-dropout 0.1 \
    --fp16 "$@"
