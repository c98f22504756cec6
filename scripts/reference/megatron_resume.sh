#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py resumes training from a checkpoint megatron-rs wrote (issue 14).
# Megatron's golden torch-format run (../shared/golden/megatron_checkpoints/gpt_torch, iteration 3,
# with its optimizer) is imported, trained two more iterations by our pretrain_gpt, exported in
# Megatron's torch format by checkpoint_convert --saver core, and Megatron continues it for two
# iterations; ours continues the same checkpoint for comparison. Both print their iteration 6
# and 7 log lines: the losses agree to bf16 noise when the two runs see the same mock data.
#
# Needs a GPU (Megatron trains on CUDA), python3 with torch, and Megatron-LM's source at
# core_v0.14.0 (with einops and pybind11 installed; Transformer Engine is not needed).
#
#   MEGATRON_PATH=~/Megatron-LM BIN=target/release scripts/reference/megatron_resume.sh
#
# Environment: MEGATRON_PATH (required), BIN [target/release], GOLDEN [../shared/golden/
# megatron_checkpoints/gpt_torch], DEVICE for our runs [cpu].
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
: "${MEGATRON_PATH:?set MEGATRON_PATH to a Megatron-LM checkout at core_v0.14.0}"
BIN="${BIN:-$ROOT/target/release}"
GOLDEN="${GOLDEN:-$ROOT/../shared/golden/megatron_checkpoints/gpt_torch}"
DEVICE="${DEVICE:-cpu}"
# shellcheck source=../torch-env.sh
source "$ROOT/scripts/torch-env.sh" python3
SCRATCH="$(mktemp -d -t megatron-resume.XXXXXX)"
trap 'rm -rf "$SCRATCH"' EXIT

# The golden run's flags (its README), shared by both trainers.
MODEL=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64
       --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3
       --min-lr 1e-4 --lr-decay-style cosine --mock-data --tokenizer-type NullTokenizer
       --vocab-size 8192 --bf16 --no-bias-gelu-fusion --eval-iters 0 --log-interval 1 --seed 1234)

"$BIN/checkpoint_convert" --model-type GPT --loader core --saver megatron-rs \
    --load-dir "$GOLDEN" --save-dir "$SCRATCH/ours3" >&2
"$BIN/pretrain_gpt" "${MODEL[@]}" --device "$DEVICE" --train-iters 5 --override-opt_param-scheduler \
    --load "$SCRATCH/ours3" --save "$SCRATCH/ours5" --save-interval 5 >"$SCRATCH/ours5.log" 2>&1
"$BIN/checkpoint_convert" --model-type GPT --loader megatron-rs --saver core \
    --load-dir "$SCRATCH/ours5" --save-dir "$SCRATCH/for_megatron" >&2

echo "== megatron-rs continues its checkpoint (iteration 5)"
"$BIN/pretrain_gpt" "${MODEL[@]}" --device "$DEVICE" --train-iters 7 --override-opt_param-scheduler \
    --load "$SCRATCH/ours5" 2>&1 | grep -E "iteration +[67]/"

echo "== Megatron-LM's pretrain_gpt.py continues the exported checkpoint"
# The export carries rng_state as Megatron's start seeds it (docs/checkpoints.md, RNG state), so
# Megatron loads it without --no-load-rng.
(cd "$MEGATRON_PATH" && CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc-per-node 1 pretrain_gpt.py \
    "${MODEL[@]}" --train-iters 7 --transformer-impl local --no-gradient-accumulation-fusion \
    --no-masked-softmax-fusion --no-persist-layer-norm --no-bias-dropout-fusion --no-rope-fusion \
    --attention-backend unfused --ckpt-format torch --load "$SCRATCH/for_megatron" \
    --override-opt_param-scheduler) >"$SCRATCH/megatron.log" 2>&1 \
    || { tail -30 "$SCRATCH/megatron.log" >&2; exit 1; }
grep -E "successfully loaded checkpoint|iteration +[67]/" "$SCRATCH/megatron.log"
