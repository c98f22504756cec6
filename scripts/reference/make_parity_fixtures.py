#!/usr/bin/env python3
"""Writes the HuggingFace parity fixtures under tests/fixtures/parity/<case>/.

Each case is a tiny randomly initialised HF causal LM (GPT-2 and Llama) with:
  model.safetensors  the HF state dict (float32, HF key names, tied weights stored once, exactly as
                     `save_pretrained` writes it)
  io.safetensors     `input_ids` int64 [2, 16] and the reference `logits` float32 [2, 16, 101]
  config.json        {"hf_config": <config.to_dict()>, "megatron_args": <Megatron flags, no dashes>}

The reference logits are computed with the model cast to float64 (the cast of float32 weights is
exact) and only then rounded to float32, so they carry no float32 accumulation error of their own.
Every generator is seeded, so rerunning the script rewrites byte-identical files.

Written against: python 3.11, torch 2.11.0, transformers 5.23.0, safetensors 0.8.0, numpy 2.4.6.

Usage: .venv/bin/python scripts/reference/make_parity_fixtures.py [--out tests/fixtures/parity]
"""

import argparse
import copy
import json
import shutil
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

VOCAB_SIZE = 101  # deliberately not a multiple of 128, so Megatron pads it (to 128)
BATCH = 2
SEQ_LENGTH = 16
MAX_POSITIONS = 32
HIDDEN = 64
LAYERS = 2
HEADS = 4

MATRIX_STD = 0.02
BIAS_STD = 0.05
NORM_WEIGHT_STD = 0.1
NORM_BIAS_STD = 0.05


def gpt2_case():
    config = GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=MAX_POSITIONS,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        activation_function="gelu_new",
        layer_norm_epsilon=1e-5,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        tie_word_embeddings=True,
        # Megatron's GPT-2 converter uses the last id for both; HF's 50256 is outside this vocab.
        bos_token_id=VOCAB_SIZE - 1,
        eos_token_id=VOCAB_SIZE - 1,
    )
    megatron_args = {
        "num_layers": LAYERS,
        "hidden_size": HIDDEN,
        "ffn_hidden_size": 4 * HIDDEN,
        "num_attention_heads": HEADS,
        "seq_length": SEQ_LENGTH,
        "max_position_embeddings": MAX_POSITIONS,
        "vocab_size": VOCAB_SIZE,
        "make_vocab_size_divisible_by": 128,
        "norm_epsilon": 1e-5,
        "normalization": "LayerNorm",
        "position_embedding_type": "learned_absolute",
        # Megatron's fused bias-GeLU is the tanh approximation, which is HF's "gelu_new".
        "bias_gelu_fusion": True,
        "untie_embeddings_and_output_weights": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    }
    return GPT2LMHeadModel, config, megatron_args


def llama_case():
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=176,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        hidden_act="silu",
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
    )
    megatron_args = {
        "num_layers": LAYERS,
        "hidden_size": HIDDEN,
        # 176 is not Megatron's swiglu default (floor(8h/3/64)*64 = 128), so it must be given.
        "ffn_hidden_size": 176,
        "num_attention_heads": HEADS,
        "group_query_attention": True,
        "num_query_groups": 2,
        "seq_length": SEQ_LENGTH,
        "max_position_embeddings": MAX_POSITIONS,
        "vocab_size": VOCAB_SIZE,
        "make_vocab_size_divisible_by": 128,
        "norm_epsilon": 1e-5,
        "normalization": "RMSNorm",
        "position_embedding_type": "rope",
        "rotary_base": 10000,
        "swiglu": True,
        "untie_embeddings_and_output_weights": True,
        "disable_bias_linear": True,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    }
    return LlamaForCausalLM, config, megatron_args


CASES = {"gpt2": gpt2_case, "llama": llama_case}


def is_norm(name):
    # GPT-2: ln_1, ln_2, ln_f; Llama: input_layernorm, post_attention_layernorm, model.norm.
    leaf = name.rsplit(".", 2)[-2]
    return leaf.startswith("ln_") or leaf.endswith("layernorm") or leaf == "norm"


@torch.no_grad()
def randomize(model, generator):
    """Gives every parameter non-trivial random values so that each one affects the logits.

    HF's default init leaves biases at 0 and norm weights at 1, which would let a converter that
    drops or swaps them pass unnoticed. Parameters are visited in sorted name order so the values
    depend only on the seed, not on module registration order.
    """
    for name, param in sorted(model.named_parameters()):
        if is_norm(name) and name.endswith(".weight"):
            values = 1.0 + NORM_WEIGHT_STD * torch.randn(param.shape, generator=generator)
        elif is_norm(name):
            values = NORM_BIAS_STD * torch.randn(param.shape, generator=generator)
        elif param.dim() >= 2:
            values = MATRIX_STD * torch.randn(param.shape, generator=generator)
        else:
            values = BIAS_STD * torch.randn(param.shape, generator=generator)
        param.copy_(values)


def write_hf_state_dict(model, path):
    # save_pretrained is what decides which tied copy is stored; keep only its weights file.
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        shutil.copyfile(Path(tmp) / "model.safetensors", path)


def write_case(name, out_dir, seed):
    model_class, config, megatron_args = CASES[name]()
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_class(config).eval()
    generator = torch.Generator().manual_seed(seed)
    randomize(model, generator)
    input_ids = torch.randint(0, VOCAB_SIZE, (BATCH, SEQ_LENGTH), generator=generator)

    with torch.no_grad():
        logits = copy.deepcopy(model).double()(input_ids).logits.float()

    case_dir = out_dir / name
    case_dir.mkdir(parents=True, exist_ok=True)
    write_hf_state_dict(model, case_dir / "model.safetensors")
    save_file(
        {"input_ids": input_ids.contiguous(), "logits": logits.contiguous()},
        case_dir / "io.safetensors",
    )
    config_json = {"hf_config": model.config.to_dict(), "megatron_args": megatron_args}
    (case_dir / "config.json").write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    print(f"{case_dir}: logits {tuple(logits.shape)}, |logits| max {logits.abs().max():.4f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "parity",
        help="directory that receives one sub-directory per case",
    )
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    for offset, name in enumerate(CASES):
        write_case(name, args.out, args.seed + offset)


if __name__ == "__main__":
    main()
