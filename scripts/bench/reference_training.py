"""The timed training loop the PyTorch references of the training benchmarks share
(reference_bert.py, reference_t5.py): AdamW (fused on CUDA) with weight decay on matrices only,
optional torch.compile and bf16 autocast, gradient accumulation over micro-batches, global-norm
clipping, Megatron-style progress lines on stderr, and the result row the benchmark tables read;
and the flags of that loop, which both references take after their model's.
"""

import math
import sys
import time
from contextlib import nullcontext

import torch

H100_SXM_BF16_DENSE_TFLOPS = 989.4


def add_training_arguments(p, vocab_size, micro_batch_size, global_batch_size):
    """Adds to the parser `p` the vocabulary, dropout, batch, optimizer and benchmark flags,
    with the model family's defaults for the vocabulary and the batch sizes."""
    p.add_argument("--vocab-size", type=int, default=vocab_size, help="true (unpadded) vocabulary")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--hidden-dropout", type=float, default=0.1)
    p.add_argument("--attention-dropout", type=float, default=0.1)
    p.add_argument("--micro-batch-size", type=int, default=micro_batch_size)
    p.add_argument("--global-batch-size", type=int, default=global_batch_size)
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


def finish_training_arguments(p, args):
    """Fills in what the flags of add_training_arguments imply (device, padded vocabulary,
    micro-batches per iteration) and refuses a run too short to time; returns `args`."""
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    multiple = args.make_vocab_size_divisible_by
    # Megatron pads the vocabulary; the reference uses the same padded size.
    args.padded_vocab_size = math.ceil(args.vocab_size / multiple) * multiple
    args.num_microbatches = args.global_batch_size // args.micro_batch_size
    if args.train_iters <= args.skip_timing_iters:
        p.error("--train-iters must exceed --skip-timing-iters")
    return args


def train_timed(args, model, name, microbatch_loss, flops_per_iteration, tokens_per_iteration):
    """Trains `model` for args.train_iters iterations; `microbatch_loss(forward, generator)` runs
    one micro-batch of random data through `forward` (the model, compiled with
    --torch-compile) and returns its loss. Times the iterations after --skip-timing-iters."""
    device = torch.device(args.device)
    model = model.to(device).train()
    parameters = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, fused=device.type == "cuda")
    forward = torch.compile(model) if args.torch_compile else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.bf16 else nullcontext()
    generator = torch.Generator(device=device).manual_seed(args.seed)
    print(f"model: {parameters:,} parameters", file=sys.stderr)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    measured_start, interval_start = None, time.perf_counter()
    for iteration in range(1, args.train_iters + 1):
        if iteration == args.skip_timing_iters + 1:
            sync()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            measured_start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=device)
        for _ in range(args.num_microbatches):
            with autocast:
                loss = microbatch_loss(forward, generator)
            loss = loss.float() / args.num_microbatches
            loss.backward()
            loss_sum += loss.detach()
        if args.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        optimizer.step()
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            sync()
            now = time.perf_counter()
            interval = iteration % args.log_interval or args.log_interval
            print(f"iteration {iteration:8d}/{args.train_iters:8d} | elapsed time per iteration (ms): "
                  f"{(now - interval_start) * 1000 / interval:.1f} | loss: {loss_sum.item():.6E}",
                  file=sys.stderr)
            interval_start = now
    sync()
    seconds = (time.perf_counter() - measured_start) / (args.train_iters - args.skip_timing_iters)
    tflops = flops_per_iteration / seconds / 1e12
    return {
        "impl": "pytorch-compile" if args.torch_compile else "pytorch-eager",
        "model": name,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "parameters": parameters,
        "ms_per_iter": round(seconds * 1000, 3),
        "tokens_per_s": round(tokens_per_iteration / seconds, 1),
        "tflops_per_gpu": round(tflops, 3),
        "mfu": round(tflops / args.peak_tflops, 5),
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
