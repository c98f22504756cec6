"""A megatron-rs GPT checkpoint (learned positions, LayerNorm, GeLU, tied embeddings, TP=PP=1)
as a HuggingFace GPT2LMHeadModel, for side-by-side benchmarks: `load(checkpoint_dir)`."""
import json
import os

import torch
from safetensors.torch import load_file


def load(root):
    with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
        tracked = f.read().strip()
    directory = os.path.join(root, "release" if tracked == "release" else f"iter_{int(tracked):07d}")
    meta = json.load(open(os.path.join(directory, "metadata.json")))
    cfg = meta["model"]
    if meta["tensor_model_parallel_size"] != 1 or meta["pipeline_model_parallel_size"] != 1:
        raise SystemExit("gpt_to_hf.py converts TP=1 PP=1 checkpoints")
    ours = load_file(os.path.join(directory, "mp_rank_00", "model.safetensors"))
    from transformers import GPT2Config, GPT2LMHeadModel

    h, n = cfg["hidden_size"], cfg["num_attention_heads"]
    d = cfg["kv_channels"]
    vocab = ours["embedding.word_embeddings.weight"].shape[0]
    config = GPT2Config(vocab_size=vocab, n_positions=cfg["max_position_embeddings"], n_embd=h,
                        n_layer=cfg["num_layers"], n_head=n, n_inner=cfg["ffn_hidden_size"],
                        activation_function="gelu_new", layer_norm_epsilon=cfg["norm_epsilon"],
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    hf = {"transformer.wte.weight": ours["embedding.word_embeddings.weight"],
          "transformer.wpe.weight": ours["embedding.position_embeddings.weight"],
          "transformer.ln_f.weight": ours["decoder.final_layernorm.weight"],
          "transformer.ln_f.bias": ours["decoder.final_layernorm.bias"]}
    for i in range(cfg["num_layers"]):
        m, t = f"decoder.layers.{i}.", f"transformer.h.{i}."
        for norm, hf_norm in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            hf[t + hf_norm + ".weight"] = ours[m + norm + ".weight"]
            hf[t + hf_norm + ".bias"] = ours[m + norm + ".bias"]
        # Megatron's per-head [q, k, v] rows → GPT-2's [all q; all k; all v] Conv1D columns.
        qkv = ours[m + "self_attention.linear_qkv.weight"].view(n, 3, d, h).permute(1, 0, 2, 3).reshape(3 * n * d, h)
        hf[t + "attn.c_attn.weight"] = qkv.t().contiguous()
        hf[t + "attn.c_attn.bias"] = ours[m + "self_attention.linear_qkv.bias"].view(n, 3, d).permute(1, 0, 2).reshape(-1)
        for linear, hf_linear in (("self_attention.linear_proj", "attn.c_proj"), ("mlp.linear_fc1", "mlp.c_fc"),
                                  ("mlp.linear_fc2", "mlp.c_proj")):
            hf[t + hf_linear + ".weight"] = ours[m + linear + ".weight"].t().contiguous()
            hf[t + hf_linear + ".bias"] = ours[m + linear + ".bias"]
    model = GPT2LMHeadModel(config)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in hf.items()}, strict=False)
    missing = [k for k in missing if not k.endswith(("attn.bias", "attn.masked_bias", "lm_head.weight"))]
    if missing or unexpected:
        raise SystemExit(f"conversion mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model
