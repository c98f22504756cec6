#!/usr/bin/env bash
# What a checkpoint save costs the training loop, synchronous against --async-save: the same
# GPT-1.3B run on one GPU (24 layers, hidden 2048, 16 heads, seq 1024, bf16, Adam: about 18 GB
# of checkpoint with the optimizer state) saving at iteration SAVE_AT and at its last one, with
# --log-interval 1 so that every iteration's time is logged.
#
# A save runs after its iteration's log line, so its cost lands in the following iterations:
# the synchronous save in iteration SAVE_AT+1 whole; the asynchronous one as the host copy in
# iteration SAVE_AT+1 and whatever the background writer takes from the iterations after it.
# The cost of a save is therefore the sum, over iterations SAVE_AT+1 to the last but one, of
# each iteration's time above the median of the iterations before the save (from the fourth).
# The last iteration's save is left out (an asynchronous one is finished at exit). Prints the
# per-iteration times around the save, each mode's cost, and the ratio async/sync (the issue
# asks for at most 10%).
#
# Environment (all optional):
#   PRETRAIN_GPT=path   the binary [default: target/release/pretrain_gpt, built here]
#   PYTHON=python3      a python with torch 2.11 (CUDA) for the library path
#   SAVE_AT=50          the iteration whose save is measured; the save interval too, so a run
#                       saves there and at its end only
#   ITERS=99            iterations per run: below 2×SAVE_AT, and long enough for the writer to
#                       finish before ITERS-1 (about 30 iterations of 1.3B on an H200)
#   SAVE_DIR=dir        where the checkpoints go [default: a temporary directory]; each mode's
#                       are removed once measured (two saves: about 36 GB at most)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
SAVE_AT="${SAVE_AT:-50}"
ITERS="${ITERS:-99}"
if [[ -z "${PRETRAIN_GPT:-}" ]]; then
    (cd "$ROOT" && cargo build --release --quiet -p pretrain_gpt)
    PRETRAIN_GPT="${CARGO_TARGET_DIR:-$ROOT/target}/release/pretrain_gpt"
fi
# shellcheck source=../torch-env.sh
source "$ROOT/scripts/torch-env.sh" "$PYTHON"
SCRATCH="$(mktemp -d -t async-save-bench.XXXXXX)"
SAVE_DIR="${SAVE_DIR:-$SCRATCH}"
trap 'rm -rf "$SCRATCH"' EXIT

# run MODE [FLAGS...]: the log of one run, its checkpoints removed.
run() {
    local mode="$1"
    shift
    local log="$SCRATCH/$mode.log" ckpt="$SAVE_DIR/ckpt-$mode"
    "$PRETRAIN_GPT" --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
        --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 4 \
        --global-batch-size 32 --train-iters "$ITERS" --lr 1e-4 --bf16 \
        --mock-data --tokenizer-type NullTokenizer --vocab-size 50256 --eval-iters 0 \
        --log-interval 1 --save "$ckpt" --save-interval "$SAVE_AT" "$@" >"$log" 2>&1 || {
        echo "async_save.sh: the $mode run failed; its log:" >&2
        tail -30 "$log" >&2
        return 1
    }
    rm -rf "$ckpt"
    grep -o 'successfully saved checkpoint.*\|scheduled an async.*' "$log" | sed "s/^/$mode: /"
}

# times MODE: "iteration milliseconds" of each logged iteration.
times() {
    sed -nE 's/.*iteration +([0-9]+)\/.*elapsed time per iteration \(ms\): ([0-9.]+).*/\1 \2/p' \
        "$SCRATCH/$1.log"
}

run sync
run async --async-save

echo
printf '%9s %12s %12s\n' iteration 'sync (ms)' 'async (ms)'
paste <(times sync) <(times async) | awk -v from="$SAVE_AT" -v to="$((ITERS - 1))" \
    '$1 >= from - 1 && $1 <= to { printf "%9d %12.1f %12.1f\n", $1, $2, $4 }'

# cost MODE: the median iteration before the save, and the milliseconds iterations
# SAVE_AT+1 .. ITERS-1 took above it.
cost() {
    local median
    median="$(times "$1" | awk -v save="$SAVE_AT" '$1 >= 4 && $1 <= save { print $2 }' | sort -n |
        awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }')"
    times "$1" | awk -v save="$SAVE_AT" -v last="$((ITERS - 1))" -v median="$median" '
        $1 > save && $1 <= last { extra += $2 - median }
        END { printf "%.1f %.1f", median, extra }'
}
read -r sync_base sync_cost <<<"$(cost sync)"
read -r async_base async_cost <<<"$(cost async)"
echo
echo "sync:  iteration ${sync_base} ms without a save; the save cost ${sync_cost} ms"
echo "async: iteration ${async_base} ms without a save; the save cost ${async_cost} ms"
awk -v a="$async_cost" -v s="$sync_cost" \
    'BEGIN { printf "async / sync save cost: %.1f%% (target: at most 10%%)\n", 100 * a / s }'
