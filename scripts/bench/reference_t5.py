#!/usr/bin/env python3
"""PyTorch reference of Megatron's T5 pretraining step, written from the spec (megatron-model.md §1.5).

It is the reference row of scripts/bench/pretrain_t5.sh. HuggingFace's T5 is a different
architecture (relative position buckets, RMSNorm, no biases), so this is a plain PyTorch module
of Megatron core's T5: one shared embedding (word + learned absolute positions), pre-LN encoder
layers under the encoder padding mask and a final LayerNorm, pre-LN decoder layers (causal
self-attention -> cross-attention over the encoder output -> GeLU MLP) and a final LayerNorm,
logits on the tied word embeddings plus a bias, the masked token-averaged cross entropy.
Attention is torch's scaled_dot_product_attention (flash / memory-efficient kernels on GPUs).
It trains as an eager (or torch.compile) PyTorch user would: fp32 parameters with bf16 autocast
(--bf16), fused AdamW with weight decay on matrices only, global-norm clipping, gradient
accumulation. Each micro-batch is random tokens with a padded encoder tail on half the rows and
a padded decoder tail, so only speed is measured.

Prints one JSON line on stdout after --train-iters iterations: ms/iter, tokens/s (encoder tokens,
as pretrain_t5 counts them), TFLOP/s (pretrain_t5's FLOPs estimate: GPT layers at the encoder
length standing for both stacks, decoder layers counted twice), MFU against --peak-tflops and
peak memory, measured after --skip-timing-iters iterations. Progress goes to stderr.

T5-220M on one GPU:
  python scripts/bench/reference_t5.py --bf16 --encoder-num-layers 12 --decoder-num-layers 12 \
      --hidden-size 768 --num-attention-heads 12 --encoder-seq-length 512 --decoder-seq-length 128
"""

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn

from reference_training import add_training_arguments, finish_training_arguments, train_timed


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--encoder-num-layers", type=int, default=12)
    p.add_argument("--decoder-num-layers", type=int, default=12)
    p.add_argument("--hidden-size", type=int, default=768)
    p.add_argument("--num-attention-heads", type=int, default=12)
    p.add_argument("--kv-channels", type=int, default=None)
    p.add_argument("--ffn-hidden-size", type=int, default=None)
    p.add_argument("--encoder-seq-length", type=int, default=512)
    p.add_argument("--decoder-seq-length", type=int, default=128)
    p.add_argument("--max-position-embeddings", type=int, default=None)
    add_training_arguments(p, vocab_size=30622, micro_batch_size=16, global_batch_size=128)
    args = p.parse_args(argv)
    args.kv_channels = args.kv_channels or args.hidden_size // args.num_attention_heads
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.max_position_embeddings = args.max_position_embeddings or args.encoder_seq_length
    return finish_training_arguments(p, args)


def flops_per_iteration(args):
    """pretrain_t5's estimate: Megatron's dense GPT formula with both stacks as layers at the
    encoder length (the decoder's counted twice: self- and cross-attention blocks)."""
    b, s, h = args.global_batch_size, args.encoder_seq_length, args.hidden_size
    layers = max(1, (args.encoder_num_layers * s + 2 * args.decoder_num_layers * args.decoder_seq_length) // s)
    mlp = 12 * layers * h * args.ffn_hidden_size
    projection = args.num_attention_heads * args.kv_channels
    attention = 12 * layers * h * projection * (1 + 1 + s / (2 * h))
    logits = 6 * h * args.padded_vocab_size
    return b * s * (mlp + attention + logits)


class Attention(nn.Module):
    def __init__(self, args, cross):
        super().__init__()
        h, projection = args.hidden_size, args.num_attention_heads * args.kv_channels
        self.heads, self.head_dim, self.cross = args.num_attention_heads, args.kv_channels, cross
        if cross:
            self.linear_q = nn.Linear(h, projection)
            self.linear_kv = nn.Linear(h, 2 * projection)
        else:
            self.linear_qkv = nn.Linear(h, 3 * projection)
        self.linear_proj = nn.Linear(projection, h)
        self.dropout = args.attention_dropout

    def forward(self, x, memory=None, mask=None, causal=False):
        b, s, _ = x.shape
        n, d = self.heads, self.head_dim
        if self.cross:
            q = self.linear_q(x).view(b, s, n, d)
            k, v = self.linear_kv(memory).view(b, memory.shape[1], n, 2 * d).split(d, dim=-1)
        else:
            q, k, v = self.linear_qkv(x).view(b, s, n, 3 * d).split(d, dim=-1)
        context = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0, is_causal=causal)
        return self.linear_proj(context.transpose(1, 2).reshape(b, s, n * d))


class Layer(nn.Module):
    def __init__(self, args, cross):
        super().__init__()
        h = args.hidden_size
        self.input_layernorm = nn.LayerNorm(h, eps=1e-5)
        self.self_attention = Attention(args, cross=False)
        if cross:
            self.pre_cross_attn_layernorm = nn.LayerNorm(h, eps=1e-5)
            self.cross_attention = Attention(args, cross=True)
        self.pre_mlp_layernorm = nn.LayerNorm(h, eps=1e-5)
        self.linear_fc1 = nn.Linear(h, args.ffn_hidden_size)
        self.linear_fc2 = nn.Linear(args.ffn_hidden_size, h)
        self.dropout = nn.Dropout(args.hidden_dropout)

    def forward(self, x, self_mask=None, causal=False, memory=None, memory_mask=None):
        x = x + self.dropout(self.self_attention(self.input_layernorm(x), mask=self_mask, causal=causal))
        if memory is not None:
            x = x + self.dropout(self.cross_attention(self.pre_cross_attn_layernorm(x), memory, memory_mask))
        return x + self.dropout(self.linear_fc2(F.gelu(self.linear_fc1(self.pre_mlp_layernorm(x)),
                                                       approximate="tanh")))


class T5(nn.Module):
    def __init__(self, args):
        super().__init__()
        h = args.hidden_size
        self.word_embeddings = nn.Embedding(args.padded_vocab_size, h)
        self.position_embeddings = nn.Embedding(args.max_position_embeddings, h)
        self.encoder = nn.ModuleList(Layer(args, cross=False) for _ in range(args.encoder_num_layers))
        self.encoder_final_layernorm = nn.LayerNorm(h, eps=1e-5)
        self.decoder = nn.ModuleList(Layer(args, cross=True) for _ in range(args.decoder_num_layers))
        self.decoder_final_layernorm = nn.LayerNorm(h, eps=1e-5)
        self.output_bias = nn.Parameter(torch.zeros(args.padded_vocab_size))
        self.dropout = nn.Dropout(args.hidden_dropout)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def embed(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.dropout(self.word_embeddings(tokens) + self.position_embeddings(positions))

    def forward(self, enc, dec, enc_keep, labels, loss_mask):
        key_mask = enc_keep[:, None, None, :]
        x = self.embed(enc)
        for layer in self.encoder:
            x = layer(x, self_mask=key_mask)
        memory = self.encoder_final_layernorm(x)
        y = self.embed(dec)
        for layer in self.decoder:
            y = layer(y, causal=True, memory=memory, memory_mask=key_mask)
        logits = F.linear(self.decoder_final_layernorm(y), self.word_embeddings.weight, self.output_bias)
        losses = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
        return (losses * loss_mask.flatten()).sum() / loss_mask.sum()


def batch(args, generator, device):
    b, se, sd = args.micro_batch_size, args.encoder_seq_length, args.decoder_seq_length
    enc = torch.randint(0, args.vocab_size, (b, se), generator=generator, device=device)
    dec = torch.randint(0, args.vocab_size, (b, sd), generator=generator, device=device)
    labels = torch.randint(0, args.vocab_size, (b, sd), generator=generator, device=device)
    enc_keep = torch.ones(b, se, dtype=torch.bool, device=device)
    enc_keep[b // 2:, 3 * se // 4:] = False
    loss_mask = torch.ones(b, sd, device=device)
    loss_mask[:, 3 * sd // 4:] = 0
    return enc, dec, enc_keep, labels, loss_mask


def train(args):
    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    def microbatch_loss(forward, generator):
        return forward(*batch(args, generator, device))

    return train_timed(args, T5(args), "spec-t5", microbatch_loss, flops_per_iteration(args),
                       args.global_batch_size * args.encoder_seq_length)


if __name__ == "__main__":
    print(json.dumps(train(parse_args())), flush=True)
