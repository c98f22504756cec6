#!/usr/bin/env python3
"""PyTorch reference of Megatron's BERT pretraining step: HuggingFace MegatronBertForPreTraining.

It is the reference row of scripts/bench/pretrain_bert.sh: the pre-LN BERT Megatron trains
(learned positions, two token types, erf-GeLU MLP of width 4h, final LayerNorm, MLM head with
dense → GeLU → LayerNorm → logits tied to the word embeddings, pooler and sentence-order head),
trained as an eager (or torch.compile) PyTorch user would: fp32 parameters with bf16 autocast
(--bf16), fused AdamW with weight decay on matrices only, global-norm gradient clipping and
gradient accumulation. Each micro-batch is random tokens with 15 % of positions predicted, a
random padded tail on half the rows and random sentence-order labels, so only speed is measured.

Prints one JSON line on stdout after --train-iters iterations: ms/iter, tokens/s, TFLOP/s
(Megatron's FLOPs formula), MFU against --peak-tflops and peak memory, measured after the first
--skip-timing-iters iterations. Progress goes to stderr. Tested with torch 2.11.0 and
transformers 5.23.0.

BERT-345M on one GPU:
  python scripts/bench/reference_bert.py --bf16 --num-layers 24 --hidden-size 1024 \
      --num-attention-heads 16 --seq-length 512 --micro-batch-size 8 --global-batch-size 64
"""

import argparse
import json

import torch
from transformers import MegatronBertConfig, MegatronBertForPreTraining

from reference_training import add_training_arguments, finish_training_arguments, train_timed


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--num-layers", type=int, default=24)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--num-attention-heads", type=int, default=16)
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--max-position-embeddings", type=int, default=None)
    add_training_arguments(p, vocab_size=30522, micro_batch_size=8, global_batch_size=64)
    args = p.parse_args(argv)
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    return finish_training_arguments(p, args)


def megatron_flops_per_iteration(args):
    """Megatron's dense formula (core_v0.13), as pretrain_bert logs it."""
    b, s, L, h = args.global_batch_size, args.seq_length, args.num_layers, args.hidden_size
    mlp = 12 * L * h * 4 * h
    attention = 12 * L * h * h * (1 + 1 + s / (2 * h))
    logits = 6 * h * args.padded_vocab_size
    return b * s * (mlp + attention + logits)


def batch(args, generator, device):
    b, s = args.micro_batch_size, args.seq_length
    tokens = torch.randint(0, args.vocab_size, (b, s), generator=generator, device=device)
    types = (torch.arange(s, device=device) >= s // 2).long().expand(b, s)
    mask = torch.ones(b, s, dtype=torch.long, device=device)
    mask[b // 2:, 3 * s // 4:] = 0
    predicted = torch.rand(b, s, generator=generator, device=device) < 0.15
    labels = torch.where(predicted & mask.bool(), tokens, torch.full_like(tokens, -100))
    order = torch.randint(0, 2, (b,), generator=generator, device=device)
    return tokens, types, mask, labels, order


def train(args):
    torch.manual_seed(args.seed)
    config = MegatronBertConfig(
        vocab_size=args.padded_vocab_size, hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_attention_heads,
        intermediate_size=4 * args.hidden_size, max_position_embeddings=args.max_position_embeddings,
        type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-5,
        hidden_dropout_prob=args.hidden_dropout, attention_probs_dropout_prob=args.attention_dropout,
        # HF implements only its eager attention (QK^T, softmax, ·V) for this model.
        attn_implementation="eager",
    )
    device = torch.device(args.device)

    def microbatch_loss(forward, generator):
        tokens, types, mask, labels, order = batch(args, generator, device)
        return forward(input_ids=tokens, token_type_ids=types, attention_mask=mask,
                       labels=labels, next_sentence_label=order).loss

    return train_timed(args, MegatronBertForPreTraining(config), "hf-megatron-bert", microbatch_loss,
                       megatron_flops_per_iteration(args), args.global_batch_size * args.seq_length)


if __name__ == "__main__":
    print(json.dumps(train(parse_args())), flush=True)
