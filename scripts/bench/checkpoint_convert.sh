#!/usr/bin/env bash
# checkpoint_convert's speed and memory on a randomly initialised GPT checkpoint (default
# ~1.3B: 24 layers, hidden 2048, 16 heads, GPT-2 vocabulary, bf16, with its optimizer state),
# made by pretrain_gpt (one iteration, --mock-data): TP1 → TP2 reshape (optimizer included),
# Megatron's torch format with the optimizer, export to HuggingFace and that export's import at
# TP2; each timed (wall time, and peak RSS from getrusage) and reported as GB/s over the bytes
# the tool read. Every path streams tensor by tensor: peak RSS should stay flat (well under
# 1 GB) whatever the model's size. The reference row is HF transformers'
# conversion of the same checkpoint in PyTorch (scripts/bench/gpt_to_hf.py: load the
# safetensors, map, save_pretrained). Megatron's tools/checkpoint/convert.py (core_v0.14.0) does
# not convert these models without Transformer Engine or Apex, and HF's
# checkpoint_reshaping_and_interoperability.py imports the same modules (README: checkpoint_convert):
# those rows are reported as not run.
#
# Environment (all optional):
#   PYTHON=python3              python with torch + transformers for the reference
#   PRETRAIN_GPT, CHECKPOINT_CONVERT   binaries [default: target/release/*, built here]
#   LAYERS=24 HIDDEN=2048 HEADS=16 SEQ=2048   the model's shape
#   DEVICE=cuda                 where pretrain_gpt makes the checkpoint (cpu works for small shapes)
#   SAVE_OPTIM=1                0 saves and converts weights only
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
LAYERS="${LAYERS:-24}" HIDDEN="${HIDDEN:-2048}" HEADS="${HEADS:-16}" SEQ="${SEQ:-2048}"
DEVICE="${DEVICE:-cuda}"
if [[ -z "${PRETRAIN_GPT:-}" || -z "${CHECKPOINT_CONVERT:-}" ]]; then
    (cd "$ROOT" && cargo build --release --quiet -p pretrain_gpt -p checkpoint_convert)
    PRETRAIN_GPT="${PRETRAIN_GPT:-${CARGO_TARGET_DIR:-$ROOT/target}/release/pretrain_gpt}"
    CHECKPOINT_CONVERT="${CHECKPOINT_CONVERT:-${CARGO_TARGET_DIR:-$ROOT/target}/release/checkpoint_convert}"
fi
if [[ -f "$ROOT/scripts/torch-env.sh" ]]; then
    # shellcheck source=../torch-env.sh
    source "$ROOT/scripts/torch-env.sh" "$PYTHON"
fi
SCRATCH="$(mktemp -d -t convert-bench.XXXXXX)"
trap 'rm -rf "$SCRATCH"' EXIT

OPTIM=()
[[ "${SAVE_OPTIM:-1}" == 0 ]] && OPTIM=(--no-save-optim)
echo "making a random GPT checkpoint: $LAYERS layers, hidden $HIDDEN, seq $SEQ ($DEVICE)" >&2
"$PRETRAIN_GPT" --num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS" \
    --seq-length "$SEQ" --max-position-embeddings "$SEQ" --micro-batch-size 1 --global-batch-size 1 \
    --train-iters 1 --lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 50256 --bf16 \
    --eval-iters 0 --log-interval 1 --device "$DEVICE" --save "$SCRATCH/ckpt" --save-interval 1 \
    "${OPTIM[@]}" >"$SCRATCH/pretrain.log"

# Runs "$@"; prints "seconds peak_rss_MiB" (the child's wall time and peak resident memory, from
# getrusage) and keeps its stdout in $SCRATCH/out.
timed() {
    "$PYTHON" -c '
import resource, subprocess, sys, time
start = time.perf_counter()
with open(sys.argv[1], "w") as out:
    code = subprocess.call(sys.argv[2:], stdout=out)
wall = time.perf_counter() - start
print(f"{wall:.3f} {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:.0f}")
sys.exit(code)
' "$SCRATCH/out" "$@"
}
gigabytes() { du -sb "$1" | awk '{printf "%.3f", $1/1e9}'; }

INPUT_GB=$(gigabytes "$SCRATCH/ckpt")
WEIGHTS_GB=$(du -cb "$SCRATCH"/ckpt/iter_*/mp_rank_*/model.safetensors | tail -1 | awk '{printf "%.3f", $1/1e9}')
printf "%-44s %10s %8s %8s %12s\n" "conversion" "input GB" "s" "GB/s" "peak RSS MiB"
# row NAME GB SECONDS RSS
row() { printf "%-44s %10s %8.1f %8.2f %12s\n" "$1" "$2" "$3" "$(awk -v g="$2" -v s="$3" 'BEGIN{print g/s}')" "$4"; }

read -r s rss < <(timed "$CHECKPOINT_CONVERT" --model-type GPT --loader megatron-rs --saver megatron-rs \
    --load-dir "$SCRATCH/ckpt" --save-dir "$SCRATCH/tp2" --target-tensor-parallel-size 2)
row "ours: TP1 → TP2 (optimizer too)" "$INPUT_GB" "$s" "$rss"
tail -1 "$SCRATCH/out" >&2
rm -rf "$SCRATCH/tp2"
read -r s rss < <(timed "$CHECKPOINT_CONVERT" --model-type GPT --loader megatron-rs --saver core \
    --load-dir "$SCRATCH/ckpt" --save-dir "$SCRATCH/megatron")
row "ours: → Megatron torch (optimizer too)" "$INPUT_GB" "$s" "$rss"
tail -1 "$SCRATCH/out" >&2
rm -rf "$SCRATCH/megatron"
read -r s rss < <(timed "$CHECKPOINT_CONVERT" --model-type GPT --loader megatron-rs --saver hf \
    --load-dir "$SCRATCH/ckpt" --save-dir "$SCRATCH/hf" --no-optimizer)
row "ours: → HuggingFace (weights)" "$WEIGHTS_GB" "$s" "$rss"
tail -1 "$SCRATCH/out" >&2
read -r s rss < <(timed "$CHECKPOINT_CONVERT" --model-type GPT --loader hf --saver megatron-rs \
    --load-dir "$SCRATCH/hf" --save-dir "$SCRATCH/imported" --target-tensor-parallel-size 2)
row "ours: HuggingFace → TP2 (weights)" "$WEIGHTS_GB" "$s" "$rss"
tail -1 "$SCRATCH/out" >&2
rm -rf "$SCRATCH/imported"
cat >"$SCRATCH/reference.py" <<PY
import sys
sys.path.insert(0, "$ROOT/scripts/bench")
import gpt_to_hf
gpt_to_hf.load(sys.argv[1]).save_pretrained(sys.argv[2])
PY
if "$PYTHON" -c "import torch, transformers" 2>/dev/null; then
    read -r s rss < <(timed "$PYTHON" "$SCRATCH/reference.py" "$SCRATCH/ckpt" "$SCRATCH/hf_reference")
    row "HF transformers (PyTorch): → HuggingFace" "$WEIGHTS_GB" "$s" "$rss"
else
    echo "HF transformers reference: not run ($PYTHON has no torch/transformers)"
fi
echo "Megatron convert.py / HF checkpoint_reshaping_and_interoperability.py: not run (they need Transformer Engine or Apex)"
