"""An independent PyTorch Mixture-of-Experts layer written from Megatron's definitions, for the
MoE parity test (lib/models/tests/moe_reference.rs).

usage: moe_reference.py DIR

DIR/config.json gives the layer (num_experts, topk, score_function, pre_softmax,
topk_scaling_factor, load_balancing "aux_loss"/"seq_aux_loss"/"none", aux_loss_coeff,
z_loss_coeff, seq_length, aux_backward_scale; optionally expert_bias, a list added to the sigmoid
scores for the top-k choice, and capacity_factor with drop_policy "probs"/"position" and
pad_to_capacity) and DIR/inputs.safetensors its weights under
Megatron's names inside the layer's `mlp.` (router.weight, experts.local_experts.E.linear_fc1.weight
as [gate; up] for SwiGLU, ...fc2.weight, shared_experts.linear_fc1/2.weight), the input `x`
[s, b, h] and the output gradient `g`.

The layer: logits = x W_r^T; the top-k experts per token by logits (softmax over the k chosen, or
over all experts first with pre_softmax; sigmoid scores renormalised over the k when k > 1), times
the scaling factor; each chosen expert's SwiGLU MLP with its probability applied to the activation
before fc2; the weighted outputs summed per token, plus the shared expert. Training adds
Switch Transformer's load-balancing loss E/(k T^2) * sum_i P_i n_i * coeff (P_i the summed
full-softmax, or normalised sigmoid, scores; n_i the tokens whose top-k of those scores picks i;
per sequence and averaged over the batch for seq_aux_loss) and the z-loss
mean(logsumexp(logits)^2) * coeff, each entering backward as if added to the loss times
aux_backward_scale.

Writes DIR/outputs.safetensors: `y`, the assignments each expert took (`tokens_per_expert`,
padding included), the gradients `grad.x` and `grad.<weight name>` of
sum(y * g) + scale * (aux losses), and the losses divided by their coefficients
(`load_balancing_loss`, `seq_load_balancing_loss`, `z_loss`). Also `y_hf`: the same weights in
transformers' MixtralSparseMoeBlock, when the layer is Mixtral's (softmax after top-k, no
scaling, no shared expert).
"""
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file


def expert(x, fc1, fc2, scale):
    gate, up = (x @ fc1.T).chunk(2, dim=-1)
    return ((F.silu(gate) * up) * scale[:, None]) @ fc2.T


def routing(logits, cfg):
    k, kind = cfg["topk"], cfg["score_function"]
    if kind == "softmax" and cfg["pre_softmax"]:
        probs, chosen = torch.softmax(logits, dim=-1).topk(k, dim=1)
    elif kind == "softmax":
        top, chosen = logits.topk(k, dim=1)
        probs = torch.softmax(top, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        if cfg.get("expert_bias") is not None:
            # The bias steers the choice only; the probabilities are the scores.
            chosen = (scores + torch.tensor(cfg["expert_bias"])).topk(k, dim=1).indices
            probs = scores.gather(1, chosen)
        else:
            probs, chosen = scores.topk(k, dim=1)
        if k > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if cfg["topk_scaling_factor"] is not None:
        probs = probs * cfg["topk_scaling_factor"]
    return probs, chosen


def drop_tokens(probs, routed, cfg):
    """Megatron's apply_router_token_dropping: each expert keeps at most
    ceil(tokens * topk / experts * factor) tokens, its highest probabilities ("probs") or its
    earliest tokens ("position", which Megatron words as dropping the tokens at the end of the
    batch); with padding it takes exactly that many, filled with tokens of probability zero."""
    tokens, experts = probs.shape
    capacity = min(math.ceil(tokens * cfg["topk"] / experts * cfg["capacity_factor"]), tokens)
    pad = cfg["pad_to_capacity"]
    if cfg["drop_policy"] == "probs":
        rows = probs.topk(capacity, dim=0, sorted=False).indices
        mask = torch.zeros_like(routed).scatter(0, rows, True)
    else:
        mask = routed & (routed.cumsum(0) <= capacity)
        if pad:
            free = ~routed
            mask = mask | (free & (free.cumsum(0) <= capacity - mask.sum(0, keepdim=True)))
    routed = mask if pad else routed & mask
    return probs * routed, routed


def balancing_loss(logits, cfg):
    experts, k = cfg["num_experts"], cfg["topk"]
    if cfg["score_function"] == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    picked = torch.zeros_like(scores).scatter(1, scores.topk(k, dim=1).indices, 1.0)
    if cfg["load_balancing"] == "aux_loss":
        tokens = scores.shape[0]
        return experts / (k * tokens * tokens) * (scores.sum(0) * picked.sum(0)).sum()
    s = cfg["seq_length"]
    batch = scores.shape[0] // s
    per_seq = scores.view(s, batch, experts)
    counts = picked.view(s, batch, experts).sum(0)
    return experts / (k * s * s) * (per_seq.sum(0) * counts).sum() / batch


def main():
    out = Path(sys.argv[1])
    cfg = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "inputs.safetensors")
    x, g = tensors.pop("x"), tensors.pop("g")
    weights = {name: t.clone().requires_grad_(True) for name, t in tensors.items()}
    x = x.clone().requires_grad_(True)
    s, b, h = x.shape
    tokens = x.reshape(-1, h)

    logits = tokens @ weights["router.weight"].T
    probs, chosen = routing(logits, cfg)
    probs = torch.zeros_like(logits).scatter(1, chosen, probs)
    routed = torch.zeros_like(logits, dtype=torch.bool).scatter(1, chosen, True)
    if cfg.get("capacity_factor") is not None:
        probs, routed = drop_tokens(probs, routed, cfg)
    y = torch.zeros_like(tokens)
    for e in range(cfg["num_experts"]):
        rows = torch.where(routed[:, e])[0]
        prefix = f"experts.local_experts.{e}."
        y = y.index_add(
            0,
            rows,
            expert(
                tokens[rows],
                weights[prefix + "linear_fc1.weight"],
                weights[prefix + "linear_fc2.weight"],
                probs[rows, e],
            ),
        )
    if "shared_experts.linear_fc1.weight" in weights:
        ones = torch.ones(tokens.shape[0], dtype=tokens.dtype)
        y = y + expert(
            tokens,
            weights["shared_experts.linear_fc1.weight"],
            weights["shared_experts.linear_fc2.weight"],
            ones,
        )
    y = y.view(s, b, h)

    objective = (y * g).sum()
    results = {"y": y.detach(), "tokens_per_expert": routed.sum(0).float()}
    scale = cfg["aux_backward_scale"]
    if cfg["load_balancing"] != "none" and cfg["aux_loss_coeff"] > 0:
        loss = balancing_loss(logits, cfg) * cfg["aux_loss_coeff"]
        name = "load_balancing_loss" if cfg["load_balancing"] == "aux_loss" else "seq_load_balancing_loss"
        results[name] = (loss / cfg["aux_loss_coeff"]).detach().reshape(1)
        objective = objective + scale * loss
    if cfg["z_loss_coeff"] is not None:
        z = torch.logsumexp(logits, dim=-1).square().mean() * cfg["z_loss_coeff"]
        results["z_loss"] = (z / cfg["z_loss_coeff"]).detach().reshape(1)
        objective = objective + scale * z
    objective.backward()
    results["grad.x"] = x.grad
    for name, w in weights.items():
        results["grad." + name] = w.grad

    mixtral = (
        cfg["score_function"] == "softmax"
        and not cfg["pre_softmax"]
        and cfg["topk_scaling_factor"] is None
        and "shared_experts.linear_fc1.weight" not in weights
        and cfg.get("capacity_factor") is None
    )
    if mixtral:
        results["y_hf"] = mixtral_block(tensors, x.detach(), cfg)
    save_file({k: v.contiguous() for k, v in results.items()}, out / "outputs.safetensors")


def mixtral_block(tensors, x, cfg):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    experts = cfg["num_experts"]
    fc1 = tensors["experts.local_experts.0.linear_fc1.weight"]
    config = MixtralConfig(
        hidden_size=x.shape[-1],
        intermediate_size=fc1.shape[0] // 2,
        num_local_experts=experts,
        num_experts_per_tok=cfg["topk"],
        hidden_act="silu",
    )
    block = MixtralSparseMoeBlock(config).eval()
    state = {"gate.weight": tensors["router.weight"]}
    state["experts.gate_up_proj"] = torch.stack(
        [tensors[f"experts.local_experts.{e}.linear_fc1.weight"] for e in range(experts)]
    )
    state["experts.down_proj"] = torch.stack(
        [tensors[f"experts.local_experts.{e}.linear_fc2.weight"] for e in range(experts)]
    )
    block.load_state_dict(state)
    with torch.no_grad():
        # transformers takes [b, s, h].
        return block(x.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()


if __name__ == "__main__":
    main()
