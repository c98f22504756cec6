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
import math

import torch
from transformers import MegatronBertConfig, MegatronBertForPreTraining

from reference_training import train_timed

H100_SXM_BF16_DENSE_TFLOPS = 989.4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--num-layers", type=int, default=24)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--num-attention-heads", type=int, default=16)
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--max-position-embeddings", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=30522, help="true (unpadded) vocabulary")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--hidden-dropout", type=float, default=0.1)
    p.add_argument("--attention-dropout", type=float, default=0.1)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--global-batch-size", type=int, default=64)
    p.add_argument("--train-iters", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--skip-timing-iters", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=H100_SXM_BF16_DENSE_TFLOPS)
    p.add_argument("--torch-compile", action="store_true")
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    multiple = args.make_vocab_size_divisible_by
    # Megatron pads the vocabulary; the reference uses the same padded size.
    args.padded_vocab_size = math.ceil(args.vocab_size / multiple) * multiple
    args.num_microbatches = args.global_batch_size // args.micro_batch_size
    if args.train_iters <= args.skip_timing_iters:
        p.error("--train-iters must exceed --skip-timing-iters")
    return args


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
