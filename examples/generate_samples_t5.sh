#!/usr/bin/env bash
# What a T5 trained by examples/pretrain_t5.sh learned: its teacher-forced loss and token
# accuracy on validation samples, then greedy decoding of the masked spans of a few samples and
# of a sentence with sentinels. The data and tokenizer flags are pretrain_t5's; the
# architecture comes from the checkpoint. Split the model over GPUs with, e.g.,
#   torchrun --no-python --nproc-per-node 2 examples/generate_samples_t5.sh --tensor-model-parallel-size 2
set -euo pipefail
BIN="${BIN:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target/release}"

CHECKPOINT_PATH="${CHECKPOINT_PATH:-checkpoints/t5_220m}"
VOCAB_FILE="${VOCAB_FILE:-bert-vocab.txt}"
DATA_PATH="${DATA_PATH:-my-t5_text_sentence}"

COMMON_ARGS=(
    --load "$CHECKPOINT_PATH" --bf16 --micro-batch-size 16
    --vocab-file "$VOCAB_FILE" --tokenizer-type BertWordPieceCase --vocab-extra-ids 100
    --data-path "$DATA_PATH" --split 99982,9,9 --split-name valid
    --encoder-seq-length 512 --decoder-seq-length 128
)

"$BIN/generate_samples_t5" score "${COMMON_ARGS[@]}" --num-samples 1000 "$@"
"$BIN/generate_samples_t5" decode "${COMMON_ARGS[@]}" --num-samples 4 "$@"
"$BIN/generate_samples_t5" decode "${COMMON_ARGS[@]}" \
    --input "The <extra_id_0> walks in <extra_id_1> park." "$@"
