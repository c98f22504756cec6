#!/usr/bin/env bash
# Megatron's examples/run_text_generation_server_345M.sh: serve a GPT checkpoint on port 5000.
# The architecture comes from the checkpoint; give the tokenizer it was trained with. Query it with
#   curl 'http://localhost:5000/api' -X PUT -H 'Content-Type: application/json' \
#     -d '{"prompts":["Hello world"], "tokens_to_generate":32}'
# or tools-style: text_generation_cli localhost:5000
set -euo pipefail
BIN="${BIN:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target/release}"

CHECKPOINT_PATH="${CHECKPOINT_PATH:-checkpoints/gpt2_345m}"
VOCAB_FILE="${VOCAB_FILE:-gpt2-vocab.json}"
MERGE_FILE="${MERGE_FILE:-gpt2-merges.txt}"

exec "$BIN/text_generation_server" --load "$CHECKPOINT_PATH" \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" \
    --port "${PORT:-5000}" --host "${HOST:-127.0.0.1}" "$@"
