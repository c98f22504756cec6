"""HuggingFace reference for checkpoint_convert's tests.

    hf_reference.py make KIND DIR [--bin]   a tiny random model, save_pretrained(DIR); KIND is gpt2,
                                            llama, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe or a
                                            scaled-RoPE Llama: llama3, linear, yarn, yarn_mscale
    hf_reference.py logits DIR IDS                       from_pretrained(DIR) logits for IDS ("1,2,3;4,5,6")
    hf_reference.py differences DIR DIR                  the tensors of two safetensors models that are not
                                                         identical (JSON: {"tensors": n, "differences": [...]})

`logits` prints JSON: {"missing": [...], "unexpected": [...], "logits": [[[...]]], "tokenizer": class or null
(null also where AutoTokenizer cannot load the files: the reason goes to stderr)}.
Everything in float32 on the CPU.

    hf_reference.py serve                                the commands above, one JSON list of arguments a
                                                         line on stdin, each answered by a line
                                                         {"out": what it prints} or {"error": traceback};
                                                         for tests that ask many times (torch imports once)
"""
import contextlib
import io
import json
import os
import sys
import traceback

import torch
import transformers


SCALED_ROPE = {
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
    # Non-default betas, no rounding of the ramp, and DeepSeek's mscale pair (both non-zero: the
    # one case where transformers takes their ratio, as Megatron always does).
    "yarn_mscale": {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 16,
                    "beta_fast": 8.0, "beta_slow": 0.5, "truncate": False, "mscale": 1.0, "mscale_all_dim": 0.5},
}


def make(kind, directory, as_bin):
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=1000, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                         activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
    elif kind == "llama":
        config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=96,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=64, rope_theta=500000.0, rms_norm_eps=1e-5,
                                          tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    elif kind in SCALED_ROPE:
        # RoPE scalings with the original context shrunk to the tiny model's (16 positions, the
        # tests read 40), so that every band (kept, blended, stretched) has frequencies; larger
        # weights make attention (and so the rotation) matter in the logits.
        config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=96,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=64, rope_parameters=dict(SCALED_ROPE[kind]),
                                          rms_norm_eps=1e-5, initializer_range=0.2, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=96,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=64, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                          tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(config)
    elif kind == "mixtral":
        # Four experts, two per token; weights large enough that the router's choices differ
        # from token to token.
        config = transformers.MixtralConfig(vocab_size=1000, hidden_size=64, intermediate_size=96,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            num_local_experts=4, num_experts_per_tok=2,
                                            max_position_embeddings=64, rope_theta=1000000.0, rms_norm_eps=1e-5,
                                            initializer_range=0.1, tie_word_embeddings=False)
        model = transformers.MixtralForCausalLM(config)
    elif kind == "qwen3":
        # Per-head query and key norms; a head width other than hidden / heads.
        config = transformers.Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=96,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=24, max_position_embeddings=64, rope_theta=1000000.0,
                                          rms_norm_eps=1e-6, tie_word_embeddings=False)
        model = transformers.Qwen3ForCausalLM(config)
    elif kind == "qwen2_moe":
        # A gated shared expert, experts narrower than the dense layer between them (layer 1),
        # top-2 of the softmax over all four experts, not renormalised (norm_topk_prob false).
        config = transformers.Qwen2MoeConfig(vocab_size=1000, hidden_size=64, intermediate_size=96,
                                             moe_intermediate_size=48, shared_expert_intermediate_size=80,
                                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                             num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                                             decoder_sparse_step=1, mlp_only_layers=[1],
                                             max_position_embeddings=64, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                             initializer_range=0.1, tie_word_embeddings=False)
        model = transformers.Qwen2MoeForCausalLM(config)
    elif kind == "qwen3_moe":
        # Per-head query and key norms, top-2 renormalised over the two (norm_topk_prob).
        config = transformers.Qwen3MoeConfig(vocab_size=1000, hidden_size=64, intermediate_size=96,
                                             moe_intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=24, num_experts=4,
                                             num_experts_per_tok=2, norm_topk_prob=True,
                                             max_position_embeddings=64, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                             initializer_range=0.1, tie_word_embeddings=False)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        raise SystemExit(f"unknown kind {kind}")
    # Random norms and biases too, so a dropped or misplaced one shows in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in name or "ln_" in name else 0.0, 0.1)
    model.save_pretrained(directory, safe_serialization=not as_bin)


def logits(directory, ids):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True,
                                                                    dtype=torch.float32)
    model.eval()
    tokens = torch.tensor([[int(t) for t in row.split(",")] for row in ids.split(";")])
    with torch.no_grad():
        out = model(tokens).logits
    tokenizer = None
    if any(os.path.exists(os.path.join(directory, f)) for f in ("vocab.json", "tokenizer.json")):
        try:
            tokenizer = type(transformers.AutoTokenizer.from_pretrained(directory)).__name__
        except ValueError as error:
            # transformers 5 gives some model types (mixtral) a tokenizer class that needs
            # sentencepiece for a GPT-2 vocabulary: reported as no tokenizer.
            print(f"AutoTokenizer: {error}", file=sys.stderr)
    json.dump({"missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
               "logits": out.tolist(), "tokenizer": tokenizer}, sys.stdout)


def differences(first, second):
    """The tensors of two safetensors model directories that are not identical: names in one
    only, and names whose shapes or values differ."""
    from safetensors.torch import load_file

    def tensors(directory):
        out = {}
        for name in sorted(os.listdir(directory)):
            if name.endswith(".safetensors"):
                out.update(load_file(os.path.join(directory, name)))
        return out

    a, b = tensors(first), tensors(second)
    found = [f"only in {first}: {n}" for n in sorted(a.keys() - b.keys())]
    found += [f"only in {second}: {n}" for n in sorted(b.keys() - a.keys())]
    for name in sorted(a.keys() & b.keys()):
        if a[name].shape != b[name].shape or a[name].dtype != b[name].dtype or not torch.equal(a[name], b[name]):
            found.append(f"{name} differs")
    json.dump({"tensors": len(a), "differences": found}, sys.stdout)


def run(args):
    if args[0] == "make":
        make(args[1], args[2], "--bin" in args[3:])
    elif args[0] == "differences":
        differences(args[1], args[2])
    else:
        logits(args[1], args[2])


def serve():
    for line in sys.stdin:
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                run(json.loads(line))
            reply = {"out": printed.getvalue()}
        except Exception:
            reply = {"error": traceback.format_exc()}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve()
    else:
        run(sys.argv[1:])
