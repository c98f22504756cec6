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
# Measured on 2× H200 (torch 2.11.0+cu130, no Apex, no Transformer Engine, 2026-11-28): Megatron
# loads neither the export nor its own distopt_torch_dist. The first failure, a fresh torch Adam
# without `step` (below), is worked around here; the second, in dist_checkpointing's
# reformulation check (`'Metadata' object has no attribute 'mcore_data'`), is not: it is raised
# for Megatron's own save as for ours.
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
import importlib.abc, importlib.machinery, sys
import numpy
if not hasattr(numpy, "product"):
    numpy.product = numpy.prod

# core_v0.14.0 without Apex or Transformer Engine cannot load a torch_dist distributed-optimizer
# checkpoint, its own included: the template state dict built before loading reads `step` from
# a fresh torch Adam that holds no state (distrib_optimizer.py, `assert len(steps) == 1`). The
# template's values are replaced by the checkpoint's, so its Adam state is made up as zeros.
def zero_adam_state(optimizer):
    import torch
    for group in optimizer.param_groups:
        for p in group["params"]:
            if len(optimizer.state[p]) == 0:
                optimizer.state[p]["step"] = torch.tensor(0.0)
                optimizer.state[p]["exp_avg"] = torch.zeros_like(p.data)
                optimizer.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)

class PatchDistributedOptimizer(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    NAME = "megatron.core.optimizer.distrib_optimizer"
    def find_spec(self, name, path, target=None):
        if name != self.NAME:
            return None
        sys.meta_path.remove(self)
        self.spec = importlib.machinery.PathFinder.find_spec(name, path)
        self.original = self.spec.loader
        self.spec.loader = self
        return self.spec
    def create_module(self, spec):
        return self.original.create_module(spec)
    def exec_module(self, module):
        self.original.exec_module(module)
        state_dict = module.DistributedOptimizer.state_dict
        def patched(optimizer):
            zero_adam_state(optimizer.optimizer)
            return state_dict(optimizer)
        module.DistributedOptimizer.state_dict = patched

sys.meta_path.insert(0, PatchDistributedOptimizer())
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
        --load "$1") >"$2" 2>&1 || {
        echo "Megatron failed on $1; rank 0's last words (the whole log: $2):" >&2
        grep -E "^\[rank0\]" "$2" | tail -25 >&2
        return 1
    }
    grep -E "successfully loaded checkpoint" "$2"
    grep -E "iteration +([6-9]|10)/" "$2"
}

echo "== Megatron-LM continues megatron-rs's torch_dist export"
failed=0
megatron_resumes "$SCRATCH/export" "$SCRATCH/export.log" || failed=1
echo "== Megatron-LM continues its own torch_dist save of the same run"
megatron_resumes "$GOLDENS/distopt_torch_dist" "$SCRATCH/golden.log" || failed=1
echo "== Megatron-LM's original run (RNG state carried over)"
grep -E "iteration +([6-9]|10)/" "$GOLDENS/distopt_torch_dist.train.txt"
(( failed == 0 )) || exit 1

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
