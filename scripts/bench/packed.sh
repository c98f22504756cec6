#!/usr/bin/env bash
# Packed sequences on one GPU: tokens/s of pretrain_gpt with --reset-position-ids
# --reset-attention-mask --eod-mask-loss at a long sequence over a corpus of short documents,
# attention per document from their offsets (varlen flash), against the same run with the dense
# [b, 1, s, s] mask that --reset-attention-mask built before packing (a build of the commit
# before lib/models/src/layers/packed.rs came in), and against plain causal attention across
# documents (no resets: the upper bound, which mixes documents). Prints tokens/s, TFLOP/s/GPU,
# MFU and peak memory (max allocated, MB) of each; the figures are those of the last log line.
#
# The corpus: DOCS documents of 200-800 random tokens (uniform lengths, GPT-2-sized vocabulary),
# each ended by an end-of-document token, written as JSONL of space-separated ids and turned into
# an indexed dataset by preprocess_data with the NullTokenizer.
#
# Environment (all optional):
#   PRETRAIN_GPT=path        the binary with packing [default: target/release/pretrain_gpt, built here]
#   PREPROCESS_DATA=path     [default: target/release/preprocess_data, built here]
#   DENSE_PRETRAIN_GPT=path  a binary from before packing [default: built here from BASE_REV]
#   BASE_REV=rev             [default: the parent of the commit that added layers/packed.rs]
#   PYTHON=python3           a python with torch 2.11 (CUDA): libraries
#   MODEL=1.3b               1.3b | 7b
#   SEQ=8192  MBS=1  ITERS=20  DOCS=40000
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
SEQ="${SEQ:-8192}"
MBS="${MBS:-1}"
ITERS="${ITERS:-20}"
DOCS="${DOCS:-40000}"
MODEL="${MODEL:-1.3b}"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
SCRATCH="$(mktemp -d -t packed-bench.XXXXXX)"
cleanup() {
    if [[ -d "$SCRATCH/base" ]]; then git -C "$ROOT" worktree remove --force "$SCRATCH/base"; fi
    rm -rf "$SCRATCH"
}
trap cleanup EXIT

if [[ -z "${PRETRAIN_GPT:-}" || -z "${PREPROCESS_DATA:-}" ]]; then
    (cd "$ROOT" && cargo build --release --quiet -p pretrain_gpt -p preprocess_data)
fi
PRETRAIN_GPT="${PRETRAIN_GPT:-$TARGET/release/pretrain_gpt}"
PREPROCESS_DATA="${PREPROCESS_DATA:-$TARGET/release/preprocess_data}"
if [[ -z "${DENSE_PRETRAIN_GPT:-}" ]]; then
    if [[ -z "${BASE_REV:-}" ]]; then
        added="$(git -C "$ROOT" log --diff-filter=A --format=%H -1 -- lib/models/src/layers/packed.rs)"
        BASE_REV="$added^"
    fi
    git -C "$ROOT" worktree add --detach --quiet "$SCRATCH/base" "$BASE_REV"
    ln -s "$ROOT/.libtorch" "$SCRATCH/base/.libtorch" 2>/dev/null || true
    (cd "$SCRATCH/base" && CARGO_TARGET_DIR="$SCRATCH/base-target" \
        cargo build --release --quiet -p pretrain_gpt)
    DENSE_PRETRAIN_GPT="$SCRATCH/base-target/release/pretrain_gpt"
fi
# shellcheck source=../torch-env.sh
source "$ROOT/scripts/torch-env.sh" "$PYTHON"

"$PYTHON" - "$SCRATCH/corpus.jsonl" "$DOCS" <<'PY'
import json, random, sys
path, docs = sys.argv[1], int(sys.argv[2])
rng = random.Random(1234)
with open(path, "w") as out:
    for _ in range(docs):
        ids = [rng.randrange(1, 50000) for _ in range(rng.randint(200, 800) - 1)]
        out.write(json.dumps({"text": " ".join(map(str, ids))}) + "\n")
PY
"$PREPROCESS_DATA" --input "$SCRATCH/corpus.jsonl" --output-prefix "$SCRATCH/corpus" \
    --tokenizer-type NullTokenizer --vocab-size 50256 --append-eod --workers 4 >/dev/null

model_flags() {
    case "$1" in
        1.3b) echo "--num-layers 24 --hidden-size 2048 --num-attention-heads 16" ;;
        7b) echo "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008 \
--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear \
--untie-embeddings-and-output-weights" ;;
        *) echo "unknown model $1" >&2; exit 2 ;;
    esac
}

# run NAME BINARY FLAGS...: prints "tokens/s TFLOP/s/GPU MFU max-allocated-MB".
run() {
    local name="$1" binary="$2"
    shift 2
    local log="$SCRATCH/$name.log"
    # shellcheck disable=SC2046
    "$binary" $(model_flags "$MODEL") --seq-length "$SEQ" --max-position-embeddings "$SEQ" \
        --micro-batch-size "$MBS" --global-batch-size $((8 * MBS)) --train-iters "$ITERS" \
        --lr 1e-4 --bf16 --data-path "$SCRATCH/corpus_text_document" --split 100,0,0 \
        --tokenizer-type NullTokenizer --vocab-size 50256 --eval-iters 0 \
        --log-interval 10 --log-throughput "$@" >"$log" 2>&1 || {
        echo "run failed: $name; its errors:" >&2
        grep -v '^\s' "$log" | grep -i -m 10 'error' >&2 || tail -30 "$log" >&2
        echo "- - - -"
        return 0
    }
    local line tokens tflops mfu peak
    line="$(grep 'tokens per second' "$log" | tail -1)"
    tokens="$(sed -E 's/.*tokens per second: ([0-9]+).*/\1/' <<<"$line")"
    tflops="$(sed -E 's/.*\(TFLOP\/s\/GPU\): ([0-9.]+).*/\1/' <<<"$line")"
    mfu="$(sed -E 's/.*MFU: ([0-9.]+)%.*/\1/' <<<"$line")"
    peak="$(grep -m 1 'max allocated' "$log" | sed -E 's/.*max allocated: ([0-9.]+).*/\1/')"
    echo "$tokens $tflops $mfu $peak"
}

RESETS=(--reset-position-ids --reset-attention-mask --eod-mask-loss)
printf '%-22s %7s %10s %12s %7s %10s %9s\n' attention seq tokens/s TFLOP/s/GPU MFU peak-MB vs-dense
read -r dense dense_tflops dense_mfu dense_peak <<<"$(run dense "$DENSE_PRETRAIN_GPT" "${RESETS[@]}")"
for variant in "packed, per document" "causal, no resets"; do
    if [[ "$variant" == packed* ]]; then
        read -r tokens tflops mfu peak <<<"$(run packed "$PRETRAIN_GPT" "${RESETS[@]}")"
    else
        read -r tokens tflops mfu peak <<<"$(run causal "$PRETRAIN_GPT" --eod-mask-loss)"
    fi
    share="-"
    if [[ "$tokens" != "-" && "$dense" != "-" ]]; then
        share="$(awk -v a="$tokens" -v b="$dense" 'BEGIN { printf "%.2fx", a / b }')"
    fi
    printf '%-22s %7s %10s %12s %6s%% %10s %9s\n' "$variant" "$SEQ" "$tokens" "$tflops" "$mfu" "$peak" "$share"
done
printf '%-22s %7s %10s %12s %6s%% %10s %9s\n' "dense [s, s] mask" "$SEQ" "$dense" "$dense_tflops" "$dense_mfu" "$dense_peak" "1.00x"
