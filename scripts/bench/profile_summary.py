#!/usr/bin/env python3
"""Breaks the GPU time of profiled training steps into kinds of work, from Chrome traces written by
libtorch's Kineto profiler (ours: pretrain_gpt --profile --use-pytorch-profiler; PyTorch:
torch.profiler's export_chrome_trace).

Each kernel goes to the first kind whose pattern its name matches (GEMMs, attention, fp8 casts, normalisation,
cross entropy, optimizer, communication, other elementwise); memory copies and sets are their own
kind. "host gaps" is the time inside the profiled window (first to last GPU activity) when no GPU
work ran: launch overhead, synchronisation, the host waiting on itself. Figures are per step.

    profile_summary.py --steps 2 ours.json [--steps 2 reference.json ...] [--labels ours compile] [--top 25]

--top N also lists each trace's N most expensive kernels (ms per step, calls per step), so two
traces can be compared kernel by kernel.
"""

import argparse
import json
import re
import sys

KINDS = [
    ("GEMM", r"gemm|nvjet|cutlass|xmma|cublas|splitk|_mm_|addmm|matmul"),
    ("attention", r"flash|fmha|attention|attn|sdpa|cudnn"),
    # Our fp8 casts and delayed-scaling updates (ops::fp8_cast), and current scaling's amax.
    ("fp8 casts", r"fp8_cast|fp8_delayed|absmaxops|norminfops"),
    ("normalisation", r"layer_?norm|rms_?norm|gammabeta|_norm_"),
    ("cross entropy", r"softmax|nll_loss|cross_entropy|logsumexp"),
    # "lamb" must not match the "lambda" in templated elementwise kernel names; sum_squares is
    # the gradient norm of our own optimizer kernels (lib/kernels/src/ops/optimizer_kernels.rs).
    ("optimizer", r"adam|multi_tensor|foreach|lamb(?!da)|sgd|sum_squares"),
    ("communication", r"nccl"),
    ("elementwise/other", r"."),
]
COPIES = "memcpy/memset"


def gpu_events(path):
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    for event in events:
        if event.get("ph") != "X":
            continue
        category = event.get("cat", "").lower()
        if category in ("kernel", "gpu_memcpy", "gpu_memset"):
            yield category, event["name"], float(event["ts"]), float(event["dur"])


def kind_of(category, name):
    if category != "kernel":
        return COPIES
    lowered = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, lowered):
            return kind
    return KINDS[-1][0]


def busy_time(intervals):
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def summarise(path, steps):
    per_kind, per_name, intervals, kernels = {}, {}, [], 0
    for category, name, start, duration in gpu_events(path):
        kind = kind_of(category, name)
        per_kind[kind] = per_kind.get(kind, 0.0) + duration
        total, calls = per_name.get(name, (0.0, 0))
        per_name[name] = (total + duration, calls + 1)
        intervals.append((start, start + duration))
        kernels += category == "kernel"
    if not intervals:
        sys.exit(f"profile_summary: {path} holds no GPU activity (was it traced on a GPU?)")
    window = max(stop for _, stop in intervals) - min(start for start, _ in intervals)
    per_kind["host gaps"] = window - busy_time(intervals)
    to_ms = 1e-3 / steps
    return {
        "step_ms": window * to_ms,
        "kernels_per_step": kernels / steps,
        "kinds_ms": {kind: us * to_ms for kind, us in per_kind.items()},
        "kernels_ms": {name: (us * to_ms, calls / steps) for name, (us, calls) in per_name.items()},
    }


def print_top(label, summary, top):
    print(f"\n{label}: {top} most expensive kernels")
    print("| ms per step | calls per step | kind | kernel |")
    print("|---|---|---|---|")
    ranked = sorted(summary["kernels_ms"].items(), key=lambda item: -item[1][0])
    for name, (ms, calls) in ranked[:top]:
        kind = kind_of("kernel", name)
        print(f"| {ms:.2f} | {calls:.0f} | {kind} | {name[:110]} |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", help="Chrome trace files")
    p.add_argument("--steps", type=int, action="append", help="profiled steps in each trace (default 1)")
    p.add_argument("--labels", nargs="+", help="a column label per trace")
    p.add_argument("--top", type=int, default=0, help="also list each trace's N most expensive kernels")
    args = p.parse_args()
    steps = args.steps or [1] * len(args.traces)
    if len(steps) == 1:
        steps *= len(args.traces)
    labels = args.labels or args.traces
    if len(steps) != len(args.traces) or len(labels) != len(args.traces):
        p.error("give one --steps (or one for all) and one label per trace")
    summaries = [summarise(path, n) for path, n in zip(args.traces, steps)]
    kinds = [k for k, _ in KINDS] + [COPIES, "host gaps"]
    print(f"| kind (ms per step) | " + " | ".join(labels) + " |")
    print("|---|" + "---|" * len(labels))
    for kind in kinds:
        cells = []
        for s in summaries:
            ms = s["kinds_ms"].get(kind, 0.0)
            cells.append(f"{ms:.2f} ({100 * ms / s['step_ms']:.0f}%)")
        print(f"| {kind} | " + " | ".join(cells) + " |")
    print("| **step (first to last GPU activity)** | " + " | ".join(f"{s['step_ms']:.2f}" for s in summaries) + " |")
    print("| kernels per step | " + " | ".join(f"{s['kernels_per_step']:.0f}" for s in summaries) + " |")
    for label, summary in zip(labels, summaries):
        if args.top:
            print_top(label, summary, args.top)
        del summary["kernels_ms"]
    print(json.dumps({label: s for label, s in zip(labels, summaries)}))


if __name__ == "__main__":
    main()
