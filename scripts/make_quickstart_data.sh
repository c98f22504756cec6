#!/usr/bin/env bash
# Regenerates the quickstart's bundled default in data/: a corpus of this project's own docs
# and sources (data/corpus.jsonl, one JSON line per file: {"path", "text"}) and a byte-level
# BPE tokenizer of 4096 tokens trained on it with train_tokenizer (data/quickstart-vocab.json,
# data/quickstart-merges.txt). The outputs are committed; rerun after large changes to the tree.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

cargo build --locked --release --quiet -p train_tokenizer
staging="$(mktemp -d data/.corpus.XXXXXX)"
trap 'rm -rf "$staging"' EXIT

git ls-files -- '*.md' '*.rs' '*.sh' '*.py' '*.cpp' '*.h' '*.toml' ':!data/' ':!tests/fixtures/' \
  | python3 -c '
import json, sys
for path in sys.stdin.read().split("\n"):
    if path:
        text = open(path, encoding="utf-8").read()
        print(json.dumps({"path": path, "text": text}, ensure_ascii=False))
' >"$staging/corpus.jsonl"
mv "$staging/corpus.jsonl" data/corpus.jsonl

target/release/train_tokenizer --input data/corpus.jsonl --vocab-size 4096 --min-frequency 2 \
  --output-prefix data/quickstart
