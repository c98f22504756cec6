#!/usr/bin/env python3
"""The tables of scripts/bench/fp8_loss_curve.sh.

usage: loss_curve_table.py SCRATCH

Reads SCRATCH/run<i>.log (our pretrain_gpt's log lines), SCRATCH/run<i>.label and
SCRATCH/run<i>.mem (peak GPU memory, MiB); run0 is the baseline. Prints the lm loss of every
logged iteration side by side (with each run's largest relative deviation from the baseline),
then tokens/s (mean over the log intervals after the first two), MFU, peak memory and the
speed-up over the baseline, then everything as JSON.
"""
import json, os, re, sys

scratch = sys.argv[1]
runs = []
i = 0
while os.path.exists(os.path.join(scratch, f"run{i}.log")):
    lines = [l for l in open(os.path.join(scratch, f"run{i}.log")).read().splitlines()
             if " iteration " in l and "lm loss:" in l]
    field = lambda line, key: float(re.search(re.escape(key) + r": ([0-9.eE+-]+)", line).group(1))
    iteration = lambda line: int(re.search(r"iteration\s+(\d+)/", line).group(1))
    timed = lines[2:] or lines
    runs.append({
        "label": open(os.path.join(scratch, f"run{i}.label")).read().strip(),
        "losses": {iteration(l): field(l, "lm loss") for l in lines},
        "tokens_per_s": sum(field(l, "tokens per second") for l in timed) / len(timed),
        "mfu": sum(field(l, "MFU") for l in timed) / len(timed) if "MFU:" in timed[0] else None,
        "peak_gpu_memory_mib": float(open(os.path.join(scratch, f"run{i}.mem")).read().strip() or "nan"),
    })
    i += 1

base = runs[0]
steps = sorted(base["losses"])
width = max(16, *(len(r["label"]) + 2 for r in runs))
print(f"{'iteration':>10}" + "".join(f"{r['label']:>{width}}" for r in runs))
for step in steps:
    print(f"{step:>10}" + "".join(
        f"{r['losses'][step]:>{width}.4f}" if step in r["losses"] else f"{'-':>{width}}" for r in runs))
for r in runs[1:]:
    shared = [s for s in steps if s in r["losses"]]
    r["max_relative_loss_deviation"] = max(abs(r["losses"][s] - base["losses"][s]) / base["losses"][s] for s in shared)
    r["final_loss_difference"] = r["losses"][shared[-1]] - base["losses"][shared[-1]]
print()
print(f"{'run':<{width}}{'tokens/s':>12}{'MFU (bf16 peak)':>17}{'peak MiB':>10}{'speed-up':>10}{'max loss dev.':>15}")
for r in runs:
    mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1f}%"
    deviation = f"{100 * r['max_relative_loss_deviation']:.2f}%" if "max_relative_loss_deviation" in r else "-"
    print(f"{r['label']:<{width}}{r['tokens_per_s']:>12.0f}{mfu:>17}{r['peak_gpu_memory_mib']:>10.0f}"
          f"{r['tokens_per_s'] / base['tokens_per_s']:>10.3f}{deviation:>15}")
print(json.dumps({"runs": runs}))
