#!/usr/bin/env bash
# Times our preprocess_data against Megatron's tools/preprocess_data.py on the same input,
# tokenizer and worker count, side by side, on the GPT-2 golden input (1x) and on the
# same input repeated REPEAT times; prints docs/s, peak RSS and the speed ratio, and checks
# that both tools wrote byte-identical files. First it times ours alone on one document whose text
# is a single LONG_WORD_MB-megabyte word without whitespace: one pre-token for the GPT-2 BPE, whose
# merges cost O(n log n) here (Megatron's Python BPE is quadratic on it, so it is not run).
#
# Environment (all optional):
#   WORKERS=2                  --workers for both tools
#   REPEAT=10                  size of the large input, in copies of the golden input
#   LONG_WORD_MB=10            size of the one-word document
#   MEGATRON_LM_DIR=dir        an existing Megatron-LM checkout; otherwise tag $MEGATRON_TAG is
#                              cloned into the scratch directory (needs network)
#   MEGATRON_TAG=core_v0.14.0  last release whose preprocess_data.py uses the classic tokenizers
#   PYTHON=python3             a Python with torch, numpy, regex, six (and nltk) importable
#   EXTRA_PYTHONPATH=dir       prepended to PYTHONPATH for Megatron (e.g. a pip --target dir)
#   SHARED=../shared           reference material (vocabularies, golden input)
#   BENCH_DIR=$(mktemp -d)     scratch directory (inputs, outputs, the Megatron checkout)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SHARED="${SHARED:-$ROOT/../shared}"
WORKERS="${WORKERS:-2}"
REPEAT="${REPEAT:-10}"
LONG_WORD_MB="${LONG_WORD_MB:-10}"
PYTHON="${PYTHON:-python3}"
MEGATRON_TAG="${MEGATRON_TAG:-core_v0.14.0}"
BENCH_DIR="${BENCH_DIR:-$(mktemp -d -t preprocess-bench.XXXXXX)}"
mkdir -p "$BENCH_DIR"

echo "building preprocess_data (release)..." >&2
(cd "$ROOT" && cargo build --release --quiet -p preprocess_data)
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
OURS="$TARGET_DIR/release/preprocess_data"

# Runs a command under /usr/bin/time -v; prints "seconds max_rss_kib".
measure() {
    local log="$1"; shift
    /usr/bin/time -v "$@" > "$log.out" 2> "$log.err" || { echo "error: $* failed, see $log.err" >&2; exit 1; }
    local wall rss
    wall=$(grep 'Elapsed (wall clock)' "$log.err" | awk '{print $NF}' \
        | awk -F: '{ if (NF == 3) print $1*3600 + $2*60 + $3; else print $1*60 + $2 }')
    rss=$(grep 'Maximum resident set size' "$log.err" | awk '{print $NF}')
    echo "$wall $rss"
}

VOCAB="$SHARED/data/gpt2-vocab.json"
MERGES="$SHARED/data/gpt2-merges.txt"
LONG_WORD="$BENCH_DIR/long_word.jsonl"
"$PYTHON" - "$LONG_WORD" "$LONG_WORD_MB" <<'EOF'
import json, random, sys
random.seed(0)
word = "".join(random.choices("etaoinshrdlucmfwypvbgkjqxz", k=int(sys.argv[2]) * 1_000_000))
with open(sys.argv[1], "w") as f:
    f.write(json.dumps({"text": word}) + "\n")
EOF
mkdir -p "$BENCH_DIR/out_long_word"
read -r long_s long_rss < <(measure "$BENCH_DIR/out_long_word/ours" "$OURS" --input "$LONG_WORD" \
    --output-prefix "$BENCH_DIR/out_long_word/ours" --tokenizer-type GPT2BPETokenizer \
    --vocab-file "$VOCAB" --merge-file "$MERGES" --append-eod --workers 1)
awk -v mb="$LONG_WORD_MB" -v s="$long_s" -v rss="$long_rss" 'BEGIN {
    printf "one %d MB word without whitespace: %.2f s (%.2f MB/s), RSS %.1f MiB\n", mb, s, mb / s, rss / 1024 }'

MEGATRON="${MEGATRON_LM_DIR:-$BENCH_DIR/Megatron-LM}"
if [[ ! -f "$MEGATRON/tools/preprocess_data.py" ]]; then
    echo "cloning Megatron-LM $MEGATRON_TAG into $MEGATRON..." >&2
    git clone --quiet --depth 1 --branch "$MEGATRON_TAG" https://github.com/NVIDIA/Megatron-LM.git "$MEGATRON" \
        || { echo "error: cannot fetch Megatron-LM; set MEGATRON_LM_DIR to a checkout" >&2; exit 1; }
fi

GOLDEN="$SHARED/golden/preprocess/small_corpus.jsonl"
for f in "$GOLDEN" "$VOCAB" "$MERGES"; do
    [[ -f "$f" ]] || { echo "error: $f not found (set SHARED)" >&2; exit 1; }
done

INPUT_1="$BENCH_DIR/input_x1.jsonl"
INPUT_N="$BENCH_DIR/input_x$REPEAT.jsonl"
cp "$GOLDEN" "$INPUT_1"
: > "$INPUT_N"
for _ in $(seq "$REPEAT"); do cat "$GOLDEN" >> "$INPUT_N"; done

printf '%-8s %8s | %10s %10s %10s | %10s %10s %10s | %7s\n' \
    input docs "ours s" "docs/s" "RSS MiB" "megatron s" "docs/s" "RSS MiB" ratio
for input in "$INPUT_1" "$INPUT_N"; do
    name=$(basename "$input" .jsonl)
    docs=$(wc -l < "$input")
    out="$BENCH_DIR/out_$name"
    mkdir -p "$out"
    read -r our_s our_rss < <(measure "$out/ours" "$OURS" --input "$input" --output-prefix "$out/ours" \
        --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" --append-eod --workers "$WORKERS")
    read -r meg_s meg_rss < <(cd "$MEGATRON" && measure "$out/megatron" \
        env PYTHONPATH="${EXTRA_PYTHONPATH:+$EXTRA_PYTHONPATH:}$MEGATRON" "$PYTHON" tools/preprocess_data.py --input "$input" --output-prefix "$out/megatron" \
        --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" --append-eod --workers "$WORKERS")
    for ext in bin idx; do
        cmp -s "$out/ours_text_document.$ext" "$out/megatron_text_document.$ext" \
            || { echo "error: $name: .$ext differs between the tools" >&2; exit 1; }
    done
    awk -v n="$name" -v d="$docs" -v os="$our_s" -v orss="$our_rss" -v ms="$meg_s" -v mrss="$meg_rss" 'BEGIN {
        printf "%-8s %8d | %10.3f %10.0f %10.1f | %10.3f %10.0f %10.1f | %6.1fx\n",
            n, d, os, d / os, orss / 1024, ms, d / ms, mrss / 1024, ms / os }'
done
echo "outputs byte-identical; workers=$WORKERS; scratch: $BENCH_DIR" >&2
