#!/usr/bin/env python3
"""Plain PyTorch reference of a Mixtral-shaped Mixture-of-Experts GPT training step, for
scripts/bench/moe.sh: the model megatron-rs trains with

  --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear
  --untie-embeddings-and-output-weights --num-experts E --moe-router-topk K
  --moe-ffn-hidden-size F --moe-aux-loss-coeff C

written as a fast PyTorch user would: fp32 parameters under bf16 autocast, SDPA causal attention,
a router whose top-k probabilities are the softmax over the k chosen logits (Megatron's default,
which equals Mixtral's softmax-then-renormalise), Switch Transformer's load-balancing loss, the
tokens sorted by expert and each expert's MLP run as one grouped GEMM (`torch._grouped_mm`, bf16,
Hopper) or, with --experts-impl loop, one expert after the other; fused AdamW; optionally
torch.compile. Prints one JSON line on stdout (the keys training_table.py reads); the log goes to
stderr.
"""
import argparse
import json
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--num-attention-heads", type=int, default=16)
    p.add_argument("--moe-ffn-hidden-size", type=int, default=2816)
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--moe-router-topk", type=int, default=2)
    p.add_argument("--moe-aux-loss-coeff", type=float, default=1e-2)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--train-iters", type=int, default=30)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--skip-timing-iters", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--experts-impl", choices=["grouped", "loop"], default="grouped")
    p.add_argument("--torch-compile", action="store_true")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test (loop experts)")
    args = p.parse_args()
    if args.global_batch_size % args.micro_batch_size:
        p.error("--global-batch-size must be a multiple of --micro-batch-size")
    if args.moe_router_topk > args.num_experts:
        p.error("--moe-router-topk exceeds --num-experts")
    args.num_microbatches = args.global_batch_size // args.micro_batch_size
    return args


def rotary(seq, dim, device):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    return torch.cat([angles, angles], dim=-1).cos(), torch.cat([angles, angles], dim=-1).sin()


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        h = args.hidden_size
        self.heads = args.num_attention_heads
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.proj = nn.Linear(h, h, bias=False)

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        q, k = rotate(q.transpose(1, 2), cos, sin), rotate(k.transpose(1, 2), cos, sin)
        y = F.scaled_dot_product_attention(q, k.to(q.dtype), v.transpose(1, 2), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class Experts(nn.Module):
    """E SwiGLU MLPs; weights stored [E, out, in] as nn.Linear stores one."""

    def __init__(self, args):
        super().__init__()
        e, h, f = args.num_experts, args.hidden_size, args.moe_ffn_hidden_size
        self.fc1 = nn.Parameter(torch.empty(e, 2 * f, h))
        self.fc2 = nn.Parameter(torch.empty(e, h, f))
        self.grouped = args.experts_impl == "grouped"

    def forward(self, x, counts):
        if self.grouped:
            offsets = counts.cumsum(0).to(torch.int32)
            w1 = self.fc1.to(torch.bfloat16).transpose(-2, -1)
            w2 = self.fc2.to(torch.bfloat16).transpose(-2, -1)
            gate, up = torch._grouped_mm(x.to(torch.bfloat16), w1, offs=offsets).chunk(2, dim=-1)
            return torch._grouped_mm(F.silu(gate) * up, w2, offs=offsets)
        outputs = []
        for e, chunk in enumerate(x.split(counts.tolist())):
            gate, up = F.linear(chunk, self.fc1[e]).chunk(2, dim=-1)
            outputs.append(F.linear(F.silu(gate) * up, self.fc2[e]))
        return torch.cat(outputs)


class MoE(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.topk = args.moe_router_topk
        self.experts_count = args.num_experts
        self.router = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.experts = Experts(args)

    def forward(self, x):
        b, s, h = x.shape
        tokens = x.reshape(-1, h)
        logits = F.linear(tokens.float(), self.router.weight.float())
        top_logits, top_experts = logits.topk(self.topk, dim=-1)
        probs = top_logits.softmax(dim=-1)
        # Switch load balancing: E * Σ_e (tokens routed to e / assignments) * mean prob of e.
        routed = F.one_hot(top_experts, self.experts_count).sum(1).float()
        aux = self.experts_count * (
            (routed.sum(0) / routed.sum()) * logits.softmax(dim=-1).mean(0)
        ).sum()
        flat = top_experts.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.experts_count)
        out = self.experts(tokens[order // self.topk], counts)
        weighted = out.float() * probs.flatten()[order, None]
        combined = torch.zeros_like(tokens, dtype=torch.float32).index_add_(0, order // self.topk, weighted)
        return combined.to(x.dtype).view(b, s, h), aux


class Layer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.norm1 = nn.RMSNorm(args.hidden_size, eps=1e-5)
        self.attention = Attention(args)
        self.norm2 = nn.RMSNorm(args.hidden_size, eps=1e-5)
        self.moe = MoE(args)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.norm1(x), cos, sin)
        y, aux = self.moe(self.norm2(x))
        return x + y, aux


class Model(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embedding = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Layer(args) for _ in range(args.num_layers))
        self.norm = nn.RMSNorm(args.hidden_size, eps=1e-5)
        self.output = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens, cos, sin):
        x = self.embedding(tokens)
        aux_total = 0.0
        for layer in self.layers:
            x, aux = layer(x, cos, sin)
            aux_total = aux_total + aux
        return self.output(self.norm(x)), aux_total


def active_flops_per_iteration(args):
    """Megatron's formula (the one pretrain_gpt's log line uses) over active parameters: each
    MoE layer's MLP counts top-k SwiGLU experts (width × 1.5), attention its causal s/(2h) term,
    the output layer 6·h·V; the router is not counted."""
    b, s, L, h = args.global_batch_size, args.seq_length, args.num_layers, args.hidden_size
    mlp = 12 * L * h * args.moe_ffn_hidden_size * args.moe_router_topk * 1.5
    attention = 12 * L * h * h * (1 + 1 + s / h / 2)
    return b * s * (mlp + attention + 6 * h * args.vocab_size)


def main():
    args = parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(args.seed)
    model = Model(args).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device.type == "cuda")
    forward = torch.compile(model) if args.torch_compile else model
    cos, sin = rotary(args.seq_length, args.hidden_size // args.num_attention_heads, device)
    data = torch.Generator(device=device).manual_seed(args.seed)
    print(
        f"model: {sum(p.numel() for p in model.parameters()):,} parameters, experts {args.experts_impl}",
        file=sys.stderr,
    )
    start = None
    for iteration in range(1, args.train_iters + 1):
        if iteration == args.skip_timing_iters + 1:
            sync()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for _ in range(args.num_microbatches):
            tokens = torch.randint(
                0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=data, device=device
            )
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits, aux = forward(tokens[:, :-1], cos, sin)
            lm = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            loss = (lm + args.moe_aux_loss_coeff * aux) / args.num_microbatches
            loss.backward()
            total += lm.detach() / args.num_microbatches
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if iteration % args.log_interval == 0:
            print(f"iteration {iteration:6d} | lm loss {total.item():.6E}", file=sys.stderr)
    sync()
    measured = args.train_iters - args.skip_timing_iters
    seconds = (time.perf_counter() - start) / measured
    tflops = active_flops_per_iteration(args) / seconds / 1e12
    print(
        json.dumps(
            {
                "impl": "pytorch-compile" if args.torch_compile else "pytorch-eager",
                "experts": args.experts_impl,
                "ms_per_iter": round(seconds * 1000, 3),
                "tokens_per_s": round(args.global_batch_size * args.seq_length / seconds, 1),
                "tflops_per_gpu": round(tflops, 3),
                "mfu": round(tflops / args.peak_tflops, 5),
                "peak_allocated_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1)
                if device.type == "cuda"
                else None,
            }
        )
    )


if __name__ == "__main__":
    main()
