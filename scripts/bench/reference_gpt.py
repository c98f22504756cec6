#!/usr/bin/env python3
"""Plain PyTorch (eager, optionally torch.compile) reference of Megatron's GPT training step.

It is the baseline row of the training-speed benchmark: the same model Megatron builds by default
(learned absolute positions, pre-LN layers, fused QKV with Megatron's per-head [n, 3, d] row layout,
tanh-GeLU MLP of width 4h, final LayerNorm, output layer tied to the word embeddings, vocabulary
padded to a multiple of --make-vocab-size-divisible-by), trained the way an eager PyTorch user
would: fp32 parameters with bf16 autocast (--bf16), SDPA causal attention, fused AdamW with weight
decay on matrices only, global-norm gradient clipping and gradient accumulation over micro-batches.
Data is random tokens from a seeded generator, so only speed is measured.

Flags carry Megatron's names and defaults. After --train-iters iterations it prints one JSON line
on stdout: ms/iter, tokens/s, TFLOP/s (Megatron's FLOPs formula), MFU against --peak-tflops and
peak memory, all measured after the first --skip-timing-iters iterations. Progress goes to stderr.

Tested with python 3.11 and torch 2.11.0.

GPT-345M on one GPU:
  python scripts/bench/reference_gpt.py --bf16 --num-layers 24 --hidden-size 1024 \
      --num-attention-heads 16 --seq-length 1024 --micro-batch-size 8 --global-batch-size 64 \
      --train-iters 20
CPU smoke check:
  python scripts/bench/reference_gpt.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 \
      --seq-length 32 --micro-batch-size 2 --global-batch-size 4 --train-iters 5
"""

import argparse
import json
import math
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

H100_SXM_BF16_DENSE_TFLOPS = 989.4


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="PyTorch-eager reference of Megatron's GPT for the speed benchmark",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    model = p.add_argument_group("model")
    model.add_argument("--num-layers", type=int, default=24)
    model.add_argument("--hidden-size", type=int, default=1024)
    model.add_argument("--num-attention-heads", type=int, default=16)
    model.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 * hidden size")
    model.add_argument("--seq-length", type=int, default=1024)
    model.add_argument(
        "--max-position-embeddings", type=int, default=None, help="default --seq-length"
    )
    model.add_argument("--vocab-size", type=int, default=50257, help="true (unpadded) vocabulary")
    model.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    model.add_argument("--norm-epsilon", type=float, default=1e-5)
    model.add_argument("--hidden-dropout", type=float, default=0.1)
    model.add_argument("--attention-dropout", type=float, default=0.1)
    model.add_argument("--init-method-std", type=float, default=0.02)

    train = p.add_argument_group("training")
    train.add_argument("--micro-batch-size", type=int, default=8)
    train.add_argument("--global-batch-size", type=int, default=64)
    train.add_argument("--train-iters", type=int, default=20)
    train.add_argument("--lr", type=float, default=1.5e-4)
    train.add_argument("--weight-decay", type=float, default=0.01)
    train.add_argument("--adam-beta1", type=float, default=0.9)
    train.add_argument("--adam-beta2", type=float, default=0.999)
    train.add_argument("--adam-eps", type=float, default=1e-8)
    train.add_argument("--clip-grad", type=float, default=1.0, help="0 disables clipping")
    precision = train.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="bf16 autocast over fp32 parameters")
    precision.add_argument(
        "--fp16",
        action="store_true",
        help="fp16 autocast over fp32 parameters with dynamic loss scaling (torch.amp.GradScaler, "
        "started at 2^32 as Megatron's --initial-loss-scale)",
    )
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument("--log-interval", type=int, default=1)

    bench = p.add_argument_group("benchmark")
    bench.add_argument(
        "--skip-timing-iters",
        type=int,
        default=3,
        help="first iterations left out of the measurement (allocator warm-up, autotuning, compile)",
    )
    bench.add_argument(
        "--peak-tflops",
        type=float,
        default=H100_SXM_BF16_DENSE_TFLOPS,
        help="peak TFLOP/s of one device for MFU (default: dense bf16 of H100/H200 SXM)",
    )
    bench.add_argument("--torch-compile", action="store_true", help="wrap the model in torch.compile")
    bench.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    bench.add_argument(
        "--profile-trace",
        default=None,
        help="write a torch.profiler Chrome trace of the last --profile-iters iterations here",
    )
    bench.add_argument("--profile-iters", type=int, default=2)
    args = p.parse_args(argv)

    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.hidden_size % args.num_attention_heads != 0:
        p.error(
            f"--hidden-size {args.hidden_size} is not divisible by "
            f"--num-attention-heads {args.num_attention_heads}"
        )
    if args.max_position_embeddings < args.seq_length:
        p.error(
            f"--max-position-embeddings {args.max_position_embeddings} is smaller than "
            f"--seq-length {args.seq_length}"
        )
    if args.global_batch_size % args.micro_batch_size != 0:
        p.error(
            f"--global-batch-size {args.global_batch_size} is not a multiple of "
            f"--micro-batch-size {args.micro_batch_size}"
        )
    if args.train_iters <= args.skip_timing_iters:
        p.error(
            f"--train-iters {args.train_iters} leaves no iteration to time after "
            f"--skip-timing-iters {args.skip_timing_iters}"
        )
    multiple = args.make_vocab_size_divisible_by
    args.padded_vocab_size = math.ceil(args.vocab_size / multiple) * multiple
    args.num_microbatches = args.global_batch_size // args.micro_batch_size
    return args


class SelfAttention(nn.Module):
    def __init__(self, hidden, heads, attention_dropout):
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.attention_dropout = attention_dropout
        # Output rows are laid out [heads, 3 (q, k, v), head_dim], as Megatron's query_key_value.
        self.query_key_value = nn.Linear(hidden, 3 * hidden)
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        qkv = self.query_key_value(x).view(b, s, self.heads, 3, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=3))
        context = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attention_dropout if self.training else 0.0, is_causal=True
        )
        return self.dense(context.transpose(1, 2).reshape(b, s, h))


class Mlp(nn.Module):
    def __init__(self, hidden, ffn_hidden):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden, ffn_hidden)
        self.dense_4h_to_h = nn.Linear(ffn_hidden, hidden)

    def forward(self, x):
        # Megatron's default fused bias-GeLU is the tanh approximation.
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate="tanh"))


class TransformerLayer(nn.Module):
    def __init__(self, args):
        super().__init__()
        h = args.hidden_size
        self.input_layernorm = nn.LayerNorm(h, eps=args.norm_epsilon)
        self.self_attention = SelfAttention(h, args.num_attention_heads, args.attention_dropout)
        self.post_attention_layernorm = nn.LayerNorm(h, eps=args.norm_epsilon)
        self.mlp = Mlp(h, args.ffn_hidden_size)
        self.hidden_dropout = nn.Dropout(args.hidden_dropout)

    def forward(self, x):
        x = x + self.hidden_dropout(self.self_attention(self.input_layernorm(x)))
        return x + self.hidden_dropout(self.mlp(self.post_attention_layernorm(x)))


class GPTModel(nn.Module):
    """Batch-first [b, s, h] activations (SDPA's layout); the math equals Megatron's [s, b, h]."""

    def __init__(self, args):
        super().__init__()
        h = args.hidden_size
        self.word_embeddings = nn.Embedding(args.padded_vocab_size, h)
        self.position_embeddings = nn.Embedding(args.max_position_embeddings, h)
        self.embedding_dropout = nn.Dropout(args.hidden_dropout)
        self.layers = nn.ModuleList(TransformerLayer(args) for _ in range(args.num_layers))
        self.final_layernorm = nn.LayerNorm(h, eps=args.norm_epsilon)
        self.init_weights(args.init_method_std, args.num_layers)

    @torch.no_grad()
    def init_weights(self, std, num_layers):
        # Megatron: N(0, std) everywhere, N(0, std / sqrt(2L)) for the two projections that feed
        # the residual stream, zero biases, LayerNorm 1 / 0.
        output_std = std / math.sqrt(2.0 * num_layers)
        for module in self.modules():
            if isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        for layer in self.layers:
            nn.init.normal_(layer.self_attention.dense.weight, std=output_std)
            nn.init.normal_(layer.mlp.dense_4h_to_h.weight, std=output_std)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.word_embeddings(tokens) + self.position_embeddings(positions)
        x = self.embedding_dropout(x)
        for layer in self.layers:
            x = layer(x)
        return F.linear(self.final_layernorm(x), self.word_embeddings.weight)


def language_model_loss(model, tokens):
    logits = model(tokens[:, :-1])
    # Megatron computes the cross entropy on fp32 logits.
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def build_optimizer(model, args):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
        fused=True,
    )


def megatron_flops_per_iteration(args):
    """Megatron's dense-model formula (core_v0.13): no GQA, no swiglu, head dim = h / n."""
    b, s, L, h = args.global_batch_size, args.seq_length, args.num_layers, args.hidden_size
    mlp = 12 * L * h * args.ffn_hidden_size
    attention = 12 * L * h * h * (1 + 1 + s / (2 * h))
    logits = 6 * h * args.padded_vocab_size
    return b * s * (mlp + attention + logits)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(args):
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = GPTModel(args).to(device)
    num_parameters = sum(p.numel() for p in model.parameters())
    optimizer = build_optimizer(model, args)
    forward_model = torch.compile(model) if args.torch_compile else model
    if args.bf16 or args.fp16:
        autocast = torch.autocast(
            device.type, dtype=torch.bfloat16 if args.bf16 else torch.float16
        )
    else:
        autocast = nullcontext()
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**32, enabled=args.fp16)
    data = torch.Generator(device=device).manual_seed(args.seed)
    model.train()
    print(
        f"model: {num_parameters:,} parameters, padded vocab {args.padded_vocab_size}, "
        f"{args.num_microbatches} micro-batches per iteration",
        file=sys.stderr,
    )

    measured_start = None
    interval_start = time.perf_counter()
    profiler = None
    profile_from = args.train_iters - args.profile_iters + 1
    for iteration in range(1, args.train_iters + 1):
        if args.profile_trace and iteration == profile_from:
            synchronize(device)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            profiler.__enter__()
        if iteration == args.skip_timing_iters + 1:
            synchronize(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            measured_start = time.perf_counter()

        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=device)
        for _ in range(args.num_microbatches):
            tokens = torch.randint(
                0,
                args.vocab_size,
                (args.micro_batch_size, args.seq_length + 1),
                generator=data,
                device=device,
            )
            with autocast:
                loss = language_model_loss(forward_model, tokens) / args.num_microbatches
            scaler.scale(loss).backward()
            loss_sum += loss.detach()
        scaler.unscale_(optimizer)
        grad_norm = (
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            if args.clip_grad > 0
            else None
        )
        scaler.step(optimizer)
        scaler.update()

        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            synchronize(device)
            now = time.perf_counter()
            interval = iteration % args.log_interval or args.log_interval
            ms = (now - interval_start) * 1000 / interval
            interval_start = now
            norm = f" | grad norm: {grad_norm.item():.3f}" if grad_norm is not None else ""
            print(
                f"iteration {iteration:8d}/{args.train_iters:8d} | elapsed time per iteration "
                f"(ms): {ms:.1f} | lm loss: {loss_sum.item():.6E}{norm}",
                file=sys.stderr,
            )

    synchronize(device)
    elapsed = time.perf_counter() - measured_start
    if profiler is not None:
        profiler.__exit__(None, None, None)
        profiler.export_chrome_trace(args.profile_trace)
    measured_iters = args.train_iters - args.skip_timing_iters
    seconds_per_iter = elapsed / measured_iters
    tflops = megatron_flops_per_iteration(args) / seconds_per_iter / 1e12
    peak_memory = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {
        "impl": "pytorch-compile" if args.torch_compile else "pytorch-eager",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "precision": "bf16-autocast"
        if args.bf16
        else "fp16-autocast" if args.fp16 else "fp32",
        "num_layers": args.num_layers,
        "hidden_size": args.hidden_size,
        "num_attention_heads": args.num_attention_heads,
        "seq_length": args.seq_length,
        "micro_batch_size": args.micro_batch_size,
        "global_batch_size": args.global_batch_size,
        "padded_vocab_size": args.padded_vocab_size,
        "parameters": num_parameters,
        "train_iters": args.train_iters,
        "measured_iters": measured_iters,
        "ms_per_iter": round(seconds_per_iter * 1000, 3),
        "tokens_per_s": round(args.global_batch_size * args.seq_length / seconds_per_iter, 1),
        "tflops_per_gpu": round(tflops, 3),
        "mfu": round(tflops / args.peak_tflops, 5),
        "peak_tflops": args.peak_tflops,
        "peak_memory_bytes": peak_memory,
        "final_loss": round(loss_sum.item(), 6),
    }


def main():
    args = parse_args()
    print(json.dumps(train(args)), flush=True)


if __name__ == "__main__":
    main()
