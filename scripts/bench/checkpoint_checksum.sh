#!/usr/bin/env bash
# Cost of the per-file CRC-32C checksums of checkpoints: saves a GPT-345M checkpoint (one
# iteration on mock data, with Adam state: about 5.7 GB of files) with and without
# --no-checkpoint-checksums and prints pretrain_gpt's save times, then times loading it
# (generate_samples_gpt reads model.safetensors, 0.7 GB) with and without verification, best
# of 3 with the files in the page cache.
#
# Environment (all optional):
#   BIN_DIR=target/release  where pretrain_gpt and generate_samples_gpt are [default: built here]
#   PYTHON=python3          a python with torch 2.11 for the library path
#   DEVICE=auto             --device for both tools
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
DEVICE="${DEVICE:-auto}"
if [[ -z "${BIN_DIR:-}" ]]; then
    (cd "$ROOT" && cargo build --release --quiet -p pretrain_gpt -p generate_samples_gpt)
    BIN_DIR="${CARGO_TARGET_DIR:-$ROOT/target}/release"
fi
# shellcheck source=../torch-env.sh
source "$ROOT/scripts/torch-env.sh" "$PYTHON"
SCRATCH="$(mktemp -d -t checksum-bench.XXXXXX)"
trap 'rm -rf "$SCRATCH"' EXIT
TOKENIZER=(--tokenizer-type GPT2BPETokenizer --vocab-file "$ROOT/data/quickstart-vocab.json"
           --merge-file "$ROOT/data/quickstart-merges.txt")
SHAPE=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
       --max-position-embeddings 1024 --micro-batch-size 1 --global-batch-size 1
       --train-iters 1 --lr 1e-4 --mock-data --eval-iters 0 --device "$DEVICE")

for mode in checksums none; do
    flag=()
    [[ $mode == none ]] && flag=(--no-checkpoint-checksums)
    "$BIN_DIR/pretrain_gpt" "${SHAPE[@]}" "${TOKENIZER[@]}" --save "$SCRATCH/$mode" "${flag[@]}" \
        | grep -o 'successfully saved checkpoint.*' | sed "s/^/save ($mode): /"
done
du -sh "$SCRATCH/checksums/iter_0000001" "$SCRATCH/checksums/iter_0000001/mp_rank_00/model.safetensors"

load() {
    local best=999999 start end
    for _ in 1 2 3 4; do
        start=$(date +%s.%N)
        "$BIN_DIR/generate_samples_gpt" --load "$SCRATCH/checksums" "${TOKENIZER[@]}" \
            --prompt x --out-seq-length 1 --device "$DEVICE" "$@" >/dev/null
        end=$(date +%s.%N)
        best=$(echo "$start $end $best" | awk '{t = $2 - $1; print (t < $3 ? t : $3)}')
    done
    echo "$best"
}
verified=$(load)
unverified=$(load --no-checkpoint-checksums)
echo "generate_samples_gpt load+1 token: verified ${verified} s, --no-checkpoint-checksums ${unverified} s"
