#!/usr/bin/env bash
# Megatron's MNLI finetuning example (tasks/main.py --task MNLI) with our binary: the 345M BERT
# of examples/pretrain_bert.sh, five epochs over GLUE's MNLI, the accuracy on both dev sets after
# every epoch. Point the variables at GLUE's MNLI directory, the vocabulary and a pretrain_bert
# checkpoint; with 8 GPUs run it under `torchrun --no-python --nproc-per-node 8` (data parallel).
set -euo pipefail
BIN="${BIN:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target/release}"

MNLI_DIR="${MNLI_DIR:-glue_data/MNLI}"
VOCAB_FILE="${VOCAB_FILE:-bert-vocab.txt}"
PRETRAINED_CHECKPOINT="${PRETRAINED_CHECKPOINT:-checkpoints/bert_345m}"
CHECKPOINT_PATH="${CHECKPOINT_PATH:-checkpoints/bert_345m_mnli}"

exec "$BIN/eval_tasks" --task MNLI --seed 1234 \
    --train-data "$MNLI_DIR/train.tsv" \
    --valid-data "$MNLI_DIR/dev_matched.tsv" "$MNLI_DIR/dev_mismatched.tsv" \
    --tokenizer-type BertWordPieceLowerCase --vocab-file "$VOCAB_FILE" \
    --epochs 5 --pretrained-checkpoint "$PRETRAINED_CHECKPOINT" \
    --tensor-model-parallel-size 1 \
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
    --micro-batch-size 8 --lr 5.0e-5 --lr-warmup-fraction 0.065 \
    --seq-length 512 --max-position-embeddings 512 \
    --save-interval 500000 --save "$CHECKPOINT_PATH" \
    --log-interval 10 --eval-interval 100 --eval-iters 50 \
    --weight-decay 1.0e-1 --fp16 "$@"
