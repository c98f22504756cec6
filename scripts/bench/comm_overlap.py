#!/usr/bin/env python3
"""How much of a rank's communication is hidden behind its computation, from Chrome traces written
by libtorch's Kineto profiler (pretrain_gpt --profile --use-pytorch-profiler --profile-ranks ...).

For each trace, per step: the profiled window (first to last GPU activity), the time some
computation kernel ran (the union over streams), the time some NCCL kernel ran, the NCCL time
with no computation beside it ("exposed": the step waits for the network), and the time the
GPU ran nothing at all (host gaps, or every stream waiting). Exposed communication plus idle
time is what a step loses against its computation alone.

    comm_overlap.py --steps 2 rank0.json rank3.json [--labels dp4-r0 dp4-r3]
"""

import argparse

from profile_summary import gpu_events


def intervals(path):
    """(is_nccl, start, end) of every kernel, copy and set in the trace, in microseconds."""
    for _, name, start, duration in gpu_events(path):
        yield "nccl" in name.lower(), start, start + duration


def union(spans):
    """The merged, sorted spans covering `spans`."""
    merged = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def length(spans):
    return sum(end - start for start, end in spans)


def minus(spans, cover):
    """The parts of the merged `spans` outside the merged `cover`."""
    out, j = [], 0
    for start, end in spans:
        while j < len(cover) and cover[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(cover) and cover[k][0] < end:
            if cover[k][0] > cursor:
                out.append((cursor, cover[k][0]))
            cursor = max(cursor, cover[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def summary(path, steps):
    spans = list(intervals(path))
    if not spans:
        raise SystemExit(f"{path}: no GPU activity in the trace")
    compute = union((s, e) for nccl, s, e in spans if not nccl)
    comm = union((s, e) for nccl, s, e in spans if nccl)
    busy = union([(s, e) for _, s, e in spans])
    window = busy[-1][1] - busy[0][0]
    ms = 1e-3 / steps
    return {
        "window": window * ms,
        "compute": length(compute) * ms,
        "nccl": length(comm) * ms,
        "exposed nccl": length(minus(comm, compute)) * ms,
        "idle": (window - length(busy)) * ms,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--steps", type=int, default=1, help="profiled steps in each trace")
    parser.add_argument("--labels", nargs="*", help="a name for each trace")
    args = parser.parse_args()
    labels = args.labels or args.traces
    if len(labels) != len(args.traces):
        parser.error("give one label per trace")
    columns = ["window", "compute", "nccl", "exposed nccl", "idle"]
    width = max(len(label) for label in labels)
    print(f"{'ms per step':<{width}}  " + "  ".join(f"{c:>12}" for c in columns))
    for label, path in zip(labels, args.traces):
        row = summary(path, args.steps)
        print(f"{label:<{width}}  " + "  ".join(f"{row[c]:12.2f}" for c in columns))


if __name__ == "__main__":
    main()
