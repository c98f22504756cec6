#!/usr/bin/env bash
# The quickstart: sets itself up, builds the toolkit in release mode, checks the machine
# (libtorch, CUDA, the autograd shim), then runs the main job on the bundled default:
#   1. preprocess_data tokenizes data/corpus.jsonl (the project's own docs and sources) with the
#      bundled byte-level BPE tokenizer (data/quickstart-*),
#   2. pretrain_gpt trains a small GPT on it for about a minute (--exit-duration-in-mins) on the
#      GPU if there is one, else on the CPU, and saves a checkpoint,
#   3. generate_samples_gpt prints text the model writes from a few prompts.
# Outputs go to $QUICKSTART_DIR (default target/quickstart); rerunning resumes training there.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

scripts/setup.sh
cargo build --locked --release --workspace --bins
BIN=target/release
WORK="${QUICKSTART_DIR:-target/quickstart}"
MINUTES="${QUICKSTART_MINUTES:-1}"
mkdir -p "$WORK"
TOKENIZER=(--tokenizer-type GPT2BPETokenizer --vocab-file data/quickstart-vocab.json --merge-file data/quickstart-merges.txt)

"$BIN/collect_env" --self-test

echo "== 1/3 preprocess_data: data/corpus.jsonl -> $WORK/corpus_text_document"
"$BIN/preprocess_data" --input data/corpus.jsonl --output-prefix "$WORK/corpus" "${TOKENIZER[@]}" \
    --append-eod --workers 2

echo "== 2/3 pretrain_gpt: about $MINUTES minute(s) of training"
"$BIN/pretrain_gpt" --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128 \
    --max-position-embeddings 128 --micro-batch-size 8 --global-batch-size 16 \
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 20 --train-iters 5000 \
    --weight-decay 0.01 --clip-grad 1.0 --hidden-dropout 0.0 --attention-dropout 0.0 \
    --data-path "$WORK/corpus_text_document" --split 98,2,0 "${TOKENIZER[@]}" \
    --log-interval 20 --eval-interval 200 --eval-iters 4 --exit-duration-in-mins "$MINUTES" \
    --save "$WORK/checkpoints" --load "$WORK/checkpoints" --save-interval 1000 \
    --tensorboard-dir "$WORK/tensorboard"

echo "== 3/3 generate_samples_gpt: continuations from the trained model"
"$BIN/generate_samples_gpt" --load "$WORK/checkpoints" "${TOKENIZER[@]}" --out-seq-length 48 --top_k 8 \
    --prompt "pub fn " --prompt "The pretrain_gpt binary" --prompt "# "
