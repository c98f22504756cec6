#!/usr/bin/env python3
"""The table of a training-speed benchmark (scripts/bench/pretrain_gpt.sh, pretrain_bert.sh, pretrain_t5.sh).

usage: training_table.py SCRATCH [REFERENCE.json ...]

Reads our run's log (SCRATCH/ours.log: the last log line's ms/iter, tokens/s, TFLOP/s and MFU),
the logs of our extra variants (SCRATCH/variant<i>.log, labelled by SCRATCH/variant<i>.label),
each reference's JSON line, and the peak GPU memory sampled for each (SCRATCH/<name>.mem), and
prints one row per implementation with its speed relative to ours, then the rows as JSON.
"""
import json, re, sys, os
scratch, references = sys.argv[1], sys.argv[2:]
mem = lambda name: float(open(os.path.join(scratch, name + ".mem")).read().strip() or "nan")


def our_row(name, label):
    log = open(os.path.join(scratch, name + ".log")).read().splitlines()
    last = [l for l in log if " iteration " in l and "elapsed time per iteration" in l][-1]
    field = lambda key: float(re.search(re.escape(key) + r": ([0-9.]+)", last).group(1))
    return {"impl": label, "ms_per_iter": field("elapsed time per iteration (ms)"),
            "tokens_per_s": field("tokens per second"), "tflops_per_gpu": field("throughput per GPU (TFLOP/s/GPU)"),
            "mfu": field("MFU") / 100 if "MFU:" in last else None, "peak_gpu_memory_mib": mem(name)}


ours = our_row("ours", "megatron-rs")
rows = [ours]
i = 0
while os.path.exists(os.path.join(scratch, f"variant{i}.log")):
    label = open(os.path.join(scratch, f"variant{i}.label")).read().strip()
    rows.append(our_row(f"variant{i}", f"ours {label}"))
    i += 1
for path in references:
    ref = json.loads(open(path).read().strip().splitlines()[-1])
    name = "eager" if ref["impl"] == "pytorch-eager" else "compile"
    rows.append({"impl": ref["impl"], "ms_per_iter": ref["ms_per_iter"], "tokens_per_s": ref["tokens_per_s"],
                 "tflops_per_gpu": ref["tflops_per_gpu"], "mfu": ref["mfu"], "peak_gpu_memory_mib": mem(name)})
print(f"{'impl':<40}{'ms/iter':>10}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}{'peak MiB':>10}{'speed vs ours':>15}")
for row in rows:
    ratio = row["tokens_per_s"] / ours["tokens_per_s"]
    mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
    print(f"{row['impl']:<40}{row['ms_per_iter']:>10.1f}{row['tokens_per_s']:>12.0f}{row['tflops_per_gpu']:>10.1f}"
          f"{mfu:>8}{row['peak_gpu_memory_mib']:>10.0f}{ratio:>15.3f}")
print(json.dumps({"rows": rows}))
