#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py resumes a torch_dist checkpoint megatron-rs wrote, with the
# distributed optimizer at DP=2 (issue 36, point 2). Megatron's golden distributed-optimizer run
# saved in torch format (../shared/golden/megatron_checkpoints/distopt_torch, iteration 5 of 10:
# distrib_optim.pt) is exported by `checkpoint_convert --saver core --ckpt-format torch_dist`;
# Megatron continues the export to iteration 10 with --ckpt-format torch_dist
# --use-distributed-optimizer on two GPUs, and, as the reference, continues its own torch_dist
# save of the same run (distopt_torch_dist) with the same flags. Both skip the RNG state (the
# export has none), so they draw the same dropout masks: their iteration 6-10 losses must agree
# (|Δ| <= 2e-3, the bound of bf16 GPU reductions); Megatron's original log lines (which did
# carry the RNG over) are printed beside them.
#
# Needs 2 GPUs, python3 with torch and numpy, a C++ compiler and pybind11 (Megatron compiles its
# dataset helpers at start-up), and Megatron-LM's source at core_v0.14.0. Neither einops (only
# imported inside try blocks, used by hierarchical context parallelism and flash decoding) nor
# Transformer Engine nor apex is needed with --transformer-impl local. No network is used.
#
#   MEGATRON_PATH=~/Megatron-LM BIN=target/release scripts/reference/megatron_resume_torch_dist.sh
#
# Environment: MEGATRON_PATH (required), BIN [target/release], GOLDENS [../shared/golden/
# megatron_checkpoints].
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
: "${MEGATRON_PATH:?set MEGATRON_PATH to a Megatron-LM checkout at core_v0.14.0}"
BIN="${BIN:-$ROOT/target/release}"
GOLDENS="${GOLDENS:-$ROOT/../shared/golden/megatron_checkpoints}"
SCRATCH="$(mktemp -d -t megatron-resume-dist.XXXXXX)"
trap 'rm -rf "$SCRATCH"' EXIT

# core_v0.14.0's torch_dist code still calls numpy.product, which numpy 2 removed.
mkdir -p "$SCRATCH/pyshim"
cat >"$SCRATCH/pyshim/sitecustomize.py" <<'EOF'
import numpy
if not hasattr(numpy, "product"):
    numpy.product = numpy.prod
EOF

# The distributed-optimizer goldens' flags (their README).
MODEL=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64
       --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8 --train-iters 10
       --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 2 --mock-data
       --tokenizer-type NullTokenizer --vocab-size 8192 --bf16 --transformer-impl local
       --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-persist-layer-norm
       --no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion --eval-iters 0
       --log-interval 1 --seed 1234 --attention-backend unfused --distributed-backend nccl
       --use-distributed-optimizer --ckpt-format torch_dist --no-load-rng)

"$BIN/checkpoint_convert" --model-type GPT --loader core --saver core --ckpt-format torch_dist \
    --load-dir "$GOLDENS/distopt_torch" --save-dir "$SCRATCH/export" >&2

megatron_resumes() { # <checkpoint> <log>
    (cd "$MEGATRON_PATH" && PYTHONPATH="$SCRATCH/pyshim${PYTHONPATH:+:$PYTHONPATH}" \
        CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc-per-node 2 pretrain_gpt.py "${MODEL[@]}" \
        --load "$1") >"$2" 2>&1 || { tail -40 "$2" >&2; exit 1; }
    grep -E "successfully loaded checkpoint" "$2"
    grep -E "iteration +([6-9]|10)/" "$2"
}

echo "== Megatron-LM continues megatron-rs's torch_dist export"
megatron_resumes "$SCRATCH/export" "$SCRATCH/export.log"
echo "== Megatron-LM continues its own torch_dist save of the same run"
megatron_resumes "$GOLDENS/distopt_torch_dist" "$SCRATCH/golden.log"
echo "== Megatron-LM's original run (RNG state carried over)"
grep -E "iteration +([6-9]|10)/" "$GOLDENS/distopt_torch_dist.train.txt"

python3 - "$SCRATCH/export.log" "$SCRATCH/golden.log" <<'EOF'
import re, sys
def losses(path):
    return [float(m.group(1)) for m in re.finditer(r"lm loss: ([0-9.E+-]+)", open(path).read())]
ours, theirs = losses(sys.argv[1]), losses(sys.argv[2])
assert len(ours) == len(theirs) == 5, (ours, theirs)
worst = max(abs(a - b) for a, b in zip(ours, theirs))
print(f"largest |lm loss difference| over iterations 6-10: {worst:.3e}")
sys.exit(0 if worst <= 2e-3 else 1)
EOF
