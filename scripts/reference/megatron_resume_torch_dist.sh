#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py resumes a torch_dist checkpoint megatron-rs wrote, with the
# distributed optimizer (issue 36, point 2). CASE picks the model:
#
# * distopt (default, 2 GPUs): Megatron's golden distributed-optimizer run saved in torch format
#   (../shared/golden/megatron_checkpoints/distopt_torch, iteration 5 of 10: distrib_optim.pt) is
#   exported by `checkpoint_convert --saver core --ckpt-format torch_dist`; Megatron continues
#   the export to iteration 10 with --ckpt-format torch_dist --use-distributed-optimizer at DP=2,
#   and, as the reference, continues its own torch_dist save of the same run
#   (distopt_torch_dist) with the same flags.
# * moe (4 GPUs): the same with the Mixture-of-Experts goldens (moe_torch exported with
#   --target-expert-parallel-size 2 --target-data-parallel-size 4: experts under
#   `mlp.experts.experts.*`, the chained optimizer's two parts), EP=2 x DP=4, next to Megatron's
#   own moe_torch_dist.
# * llama (2 GPUs): a Llama-style model (SwiGLU, RMSNorm, RoPE, grouped-query attention, untied
#   output layer, no biases; no golden of it has the distributed optimizer) trained by our
#   pretrain_gpt with the goldens' flags, saved with --ckpt-format torch_dist at iteration 5
#   (fc1 and its optimizer state in the gate and up halves of Megatron's swiglu sharded
#   factory); Megatron continues it to iteration 10 next to our own uninterrupted run.
#
# GPUS sets the processes (one per GPU, torchrun's --nproc-per-node) of every run; by default
# each case's layout above. With fewer GPUs the export is written for them (data-parallel size
# GPUS, expert-parallel size 2 where GPUS allows, else 1) and Megatron's own save, made at the
# case's layout, is resharded at load (its distributed-optimizer state is
# fully_sharded_model_space, which any data-parallel size reads): GPUS=1 resumes every case at
# TP1·PP1·DP1·EP1 on one GPU. A reference Megatron cannot load at that layout (an
# expert-parallel save's chained optimizer read by one optimizer) is reported and skipped; the
# export is then compared with Megatron's original log lines.
#
# Both continuations skip the RNG state (the exports have none), so they draw the same dropout
# masks: their iteration 6-10 losses must agree (|delta| <= 2e-3, the bound of bf16 GPU
# reductions); Megatron's original log lines (which did carry the RNG over) are printed beside
# them where there is a golden.
#
# Needs the GPUs, python3 with torch and numpy, a C++ compiler and pybind11 (Megatron compiles
# its dataset helpers at start-up), and Megatron-LM's source at core_v0.14.0. Neither einops
# (only imported inside try blocks, used by hierarchical context parallelism and flash
# decoding) nor Transformer Engine nor apex is needed with --transformer-impl local. No network
# is used.
#
#   MEGATRON_PATH=~/Megatron-LM BIN=target/release CASE=moe scripts/reference/megatron_resume_torch_dist.sh
#
# Without Apex or Transformer Engine (torch 2.11.0+cu130), core_v0.14.0 loads no torch_dist
# distributed-optimizer checkpoint, its own included, for three reasons the shim below works
# around: a fresh torch Adam without `step`, the `step` then expected among the checkpoint's
# tensors, and no `mcore_data` in torch 2.11's metadata. With it, on one H200 (GPUS=1,
# 2026-11-29), Megatron resumed the distopt, llama and moe exports; distopt's losses equal those
# of Megatron resuming its own save (docs/checkpoints.md has the figures).
#
# Environment: MEGATRON_PATH (required), BIN [target/release], GOLDENS [../shared/golden/
# megatron_checkpoints], CASE [distopt], GPUS [2 for distopt and llama, 4 for moe].
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
: "${MEGATRON_PATH:?set MEGATRON_PATH to a Megatron-LM checkout at core_v0.14.0}"
BIN="${BIN:-$ROOT/target/release}"
GOLDENS="${GOLDENS:-$ROOT/../shared/golden/megatron_checkpoints}"
CASE="${CASE:-distopt}"
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

class PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs `patch(module)` once the module `name` has been imported."""
    def __init__(self, name, patch):
        self.name, self.patch = name, patch
    def find_spec(self, name, path, target=None):
        if name != self.name:
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
        self.patch(module)

def patch_distributed_optimizer(module):
    state_dict = module.DistributedOptimizer.state_dict
    def patched(optimizer):
        zero_adam_state(optimizer.optimizer)
        return state_dict(optimizer)
    module.DistributedOptimizer.state_dict = patched
    # Loading then sets each parameter's torch Adam `step` from the parameter groups and copies
    # every state entry from the checkpoint's tensors, which have no `step`
    # (load_parameter_state_from_fs_model_space leaves it out): the step stays as set.
    set_states = module.DistributedOptimizer._set_main_param_and_optimizer_states
    def keep_step(optimizer, model_param, tensors):
        if "step" not in tensors:
            group_index, group_order = optimizer.model_param_group_index_map[model_param]
            main_param = optimizer.optimizer.param_groups[group_index]["params"][group_order]
            step = optimizer.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = {**tensors, "step": step}
        return set_states(optimizer, model_param, tensors)
    module.DistributedOptimizer._set_main_param_and_optimizer_states = keep_step

sys.meta_path.insert(0, PatchOnImport("megatron.core.optimizer.distrib_optimizer",
                                      patch_distributed_optimizer))

# core_v0.14.0 without Transformer Engine reads an undefined `te_general_gemm` in
# moe_utils.router_gating_linear (the MoE goldens' runs patched that condition the same way):
# defined as None, the router takes its own fp32 matmul, as Megatron does without TE.
def define_te_general_gemm(module):
    if not hasattr(module, "te_general_gemm"):
        module.te_general_gemm = None

sys.meta_path.insert(0, PatchOnImport("megatron.core.transformer.moe.moe_utils",
                                      define_te_general_gemm))

# core_v0.14.0 reads the original shape of each N-D flattened tensor (the distributed
# optimizer's fully_sharded_model_space state) from `mcore_data`, which its save planner adds to
# torch's Metadata; with torch 2.11 the saved .metadata has none (Megatron's own saves included),
# and every load stops with "'Metadata' object has no attribute 'mcore_data'". Without it the
# state is taken as saved in the loading run's own tensor and pipeline layout (the case here:
# TP1·PP1 both ways), which is what a missing reformulation means.
def assume_same_layout_without_mcore_data(module):
    original = module.get_reformulation_metadata
    def reformulation_metadata(sharded_state_dict, checkpoint_dir):
        metadata = module._get_filesystem_reader(checkpoint_dir).read_metadata()
        if hasattr(metadata, "mcore_data"):
            return original(sharded_state_dict, checkpoint_dir)
        found = {}
        for sh_ten in module.nested_values(sharded_state_dict):
            if module.is_nd_flattened_tensor(sh_ten):
                found[sh_ten.key] = module.TensorReformulationMetadata(
                    sh_ten.global_shape, metadata.state_dict_metadata[sh_ten.key].size)
        return found
    module.get_reformulation_metadata = reformulation_metadata

sys.meta_path.insert(0, PatchOnImport("megatron.core.dist_checkpointing.strategies.torch",
                                      assume_same_layout_without_mcore_data))
EOF

# The distributed-optimizer goldens' flags (their README).
MODEL=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64
       --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8 --train-iters 10
       --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 2 --mock-data
       --tokenizer-type NullTokenizer --vocab-size 8192 --bf16 --eval-iters 0 --log-interval 1
       --seed 1234 --use-distributed-optimizer)
# Megatron's implementation choices of the goldens' runs (ours has one implementation).
MEGATRON_ONLY=(--transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion
       --no-persist-layer-norm --no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion
       --attention-backend unfused --distributed-backend nccl --ckpt-format torch_dist --no-load-rng)
case "$CASE" in
distopt)
    GPUS="${GPUS:-2}" GOLDEN=distopt_torch_dist
    "$BIN/checkpoint_convert" --model-type GPT --loader core --saver core --ckpt-format torch_dist \
        --target-data-parallel-size "$GPUS" \
        --load-dir "$GOLDENS/distopt_torch" --save-dir "$SCRATCH/export" >&2
    ;;
moe)
    GPUS="${GPUS:-4}" GOLDEN=moe_torch_dist
    EP=$(( GPUS % 2 == 0 ? 2 : 1 ))
    MODEL+=(--disable-bias-linear --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 128
            --moe-aux-loss-coeff 1e-2 --moe-router-load-balancing-type aux_loss
            --expert-model-parallel-size "$EP" --moe-token-dispatcher-type alltoall)
    "$BIN/checkpoint_convert" --model-type GPT --loader core --saver core --ckpt-format torch_dist \
        --target-expert-parallel-size "$EP" --target-data-parallel-size "$GPUS" \
        --load-dir "$GOLDENS/moe_torch" --save-dir "$SCRATCH/export" >&2
    ;;
llama)
    GPUS="${GPUS:-2}" GOLDEN=
    # Without dropout: each program draws its own masks, which would hide what is compared.
    MODEL+=(--position-embedding-type rope --normalization RMSNorm --swiglu --group-query-attention
            --num-query-groups 2 --untie-embeddings-and-output-weights --disable-bias-linear
            --hidden-dropout 0 --attention-dropout 0)
    ours() { # <log> <flags...>: our pretrain_gpt on the GPUs, launched as torchrun launches it
        local log="$1"
        shift
        torchrun --nproc-per-node "$GPUS" --no-python "$BIN/pretrain_gpt" "${MODEL[@]}" "$@" \
            >"$log" 2>&1 || { tail -25 "$log" >&2; return 1; }
    }
    ours "$SCRATCH/ours_full.log"
    ours "$SCRATCH/ours_save.log" --save "$SCRATCH/export" --save-interval 5 --exit-interval 5 \
        --ckpt-format torch_dist
    ;;
*)
    echo "CASE must be distopt, moe or llama, not $CASE" >&2
    exit 2
    ;;
esac

megatron_resumes() { # <checkpoint> <log>
    (cd "$MEGATRON_PATH" && PYTHONPATH="$SCRATCH/pyshim${PYTHONPATH:+:$PYTHONPATH}" \
        CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc-per-node "$GPUS" pretrain_gpt.py \
        "${MODEL[@]}" "${MEGATRON_ONLY[@]}" --load "$1") >"$2" 2>&1 || {
        echo "Megatron failed on $1; rank 0's last words (the whole log: $2):" >&2
        grep -E "^\[rank0\]" "$2" | tail -25 >&2
        return 1
    }
    grep -E "successfully loaded checkpoint" "$2"
    grep -E "iteration +([6-9]|10)/" "$2"
}

echo "== Megatron-LM continues megatron-rs's torch_dist export ($CASE, $GPUS GPUs)"
failed=0
megatron_resumes "$SCRATCH/export" "$SCRATCH/export.log" || failed=1
if [[ -n "$GOLDEN" ]]; then
    echo "== Megatron-LM continues its own torch_dist save of the same run"
    if ! megatron_resumes "$GOLDENS/$GOLDEN" "$SCRATCH/reference.log"; then
        echo "(Megatron does not resume its own save on $GPUS GPUs: compared with its original run, whose RNG state differs)" >&2
        cp "$GOLDENS/$GOLDEN.train.txt" "$SCRATCH/reference.log"
        TOLERANCE=1.5e-2
    fi
    echo "== Megatron-LM's original run (RNG state carried over)"
    grep -E "iteration +([6-9]|10)/" "$GOLDENS/$GOLDEN.train.txt"
else
    echo "== megatron-rs's uninterrupted run"
    grep -E "iteration +([6-9]|10)/" "$SCRATCH/ours_full.log"
    cp "$SCRATCH/ours_full.log" "$SCRATCH/reference.log"
fi
(( failed == 0 )) || exit 1

python3 - "$SCRATCH/export.log" "$SCRATCH/reference.log" "${TOLERANCE:-2e-3}" <<'EOF'
import re, sys
def losses(path):
    found = {int(m.group(1)): float(m.group(2)) for m in re.finditer(
        r"iteration +([0-9]+)/.*?lm loss: ([0-9.E+-]+)", open(path).read())}
    return [found.get(i) for i in range(6, 11)]
ours, theirs = losses(sys.argv[1]), losses(sys.argv[2])
assert None not in ours and None not in theirs, (ours, theirs)
worst = max(abs(a - b) for a, b in zip(ours, theirs))
bound = float(sys.argv[3])
print(f"largest |lm loss difference| over iterations 6-10: {worst:.3e} (bound {bound:g})")
sys.exit(0 if worst <= bound else 1)
EOF
