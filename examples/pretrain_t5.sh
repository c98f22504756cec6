#!/usr/bin/env bash
# Megatron's examples/t5/train_t5_220m_distributed.sh: the 220M-parameter T5 (12+12 layers,
# encoder 512 / decoder 128 tokens, 100 sentinels), with Megatron's flags. Make the data with
# sentence splitting:
#   preprocess_data --input wiki.jsonl --output-prefix my-t5 --vocab-file bert-vocab.txt \
#       --tokenizer-type BertWordPieceCase --split-sentences --workers 8
# then point the variables at it and run. On one GPU no launcher is needed; on several, e.g.
#   torchrun --no-python --nproc-per-node 4 examples/pretrain_t5.sh --tensor-model-parallel-size 2 --sequence-parallel
# Ctrl-C or SIGTERM saves a checkpoint and exits; rerunning resumes from it.
set -euo pipefail
BIN="${BIN:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target/release}"

CHECKPOINT_PATH="${CHECKPOINT_PATH:-checkpoints/t5_220m}"
VOCAB_FILE="${VOCAB_FILE:-bert-vocab.txt}"
DATA_PATH="${DATA_PATH:-my-t5_text_sentence}"
TENSORBOARD_DIR="${TENSORBOARD_DIR:-$CHECKPOINT_PATH/tensorboard}"

T5_ARGS=(
    --encoder-num-layers 12 --decoder-num-layers 12 --hidden-size 768 --num-attention-heads 12
    --kv-channels 64 --ffn-hidden-size 3072
    --encoder-seq-length 512 --decoder-seq-length 128 --max-position-embeddings 512
    --micro-batch-size 64 --global-batch-size 512
    --lr 0.0001 --train-iters 1000000 --lr-decay-iters 1000000 --lr-decay-style linear
    --min-lr 0.00001 --weight-decay 1e-2 --lr-warmup-fraction .01 --clip-grad 1.0 --bf16
    --vocab-extra-ids 100 --init-method-std 0.015
)
DATA_ARGS=(
    --data-path "$DATA_PATH" --vocab-file "$VOCAB_FILE" --tokenizer-type BertWordPieceCase
    --split 99982,9,9
)
OUTPUT_ARGS=(
    --log-interval 100 --save-interval 5000 --eval-interval 1000 --eval-iters 10
    --tensorboard-dir "$TENSORBOARD_DIR" --log-throughput
)

exec "$BIN/pretrain_t5" "${T5_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" \
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" "$@"
