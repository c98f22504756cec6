#!/usr/bin/env bash
# Zero-shot evaluation speed of eval_tasks against the same computation in PyTorch/HuggingFace
# on the same GPU with the same weights: WikiText-103 test (Megatron's --overlapping-eval 32,
# windows of 1024 tokens), GPT 345M (GPT-2-medium shape: 24 layers, hidden 1024, 16 heads,
# learned positions, tied embeddings), bf16, micro-batches of 8 windows. Reports windows/s and
# the total time of the scoring loop, and both perplexities (which must agree to bf16 precision).
#
# The weights are a pretrain_gpt checkpoint after one step on mock data (GPT-2's vocabulary);
# scripts/bench/gpt_to_hf.py converts them for HF. The HF side scores exactly eval_tasks'
# windows: same token stream (the reference's detokenizer + HF tokenizers), same masks, one
# forward per micro-batch under torch.no_grad, float32 log-softmax.
#
# Environment (all optional):
#   BIN=target/release    where pretrain_gpt and eval_tasks are [built here]
#   PYTHON=python3        a python with torch 2.11 (CUDA), transformers and tokenizers
#   DATA=../shared/data   gpt2-vocab.json, gpt2-merges.txt, gpt2-tokenizer.json, wikitext103_test.tokens
#   BATCH=8               windows per forward pass, both sides
#   SKIP_HF=1             measure only megatron-rs
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
DATA="${DATA:-$ROOT/../shared/data}"
[[ -d "$DATA" ]] || DATA="$ROOT/shared/data"
BATCH="${BATCH:-8}"
if [[ -z "${BIN:-}" ]]; then
    (cd "$ROOT" && cargo build --release --quiet -p pretrain_gpt -p eval_tasks)
    BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release"
fi
# shellcheck source=../torch-env.sh
source "$ROOT/scripts/torch-env.sh" "$PYTHON"
SCRATCH="$(mktemp -d -t eval-bench.XXXXXX)"
trap 'rm -rf "$SCRATCH"' EXIT

SHAPE=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024)
TOKENIZER=(--tokenizer-type GPT2BPETokenizer --vocab-file "$DATA/gpt2-vocab.json" --merge-file "$DATA/gpt2-merges.txt")
WIKI="$SCRATCH/wiki.test.tokens"
cp "$DATA/wikitext103_test.tokens" "$WIKI"
echo "== checkpoint" >&2
"$BIN/pretrain_gpt" "${SHAPE[@]}" "${TOKENIZER[@]}" --micro-batch-size 1 --global-batch-size 1 --train-iters 1 \
    --lr 1e-4 --bf16 --mock-data --eval-iters 0 --save "$SCRATCH/ckpt" >"$SCRATCH/train.log" 2>&1 \
    || { tail -20 "$SCRATCH/train.log" >&2; exit 1; }

echo "== eval_tasks" >&2
START=$(date +%s.%N)
"$BIN/eval_tasks" --task WIKITEXT103 --valid-data "$WIKI" --overlapping-eval 32 --load "$SCRATCH/ckpt" \
    "${TOKENIZER[@]}" "${SHAPE[@]}" --bf16 --eval-micro-batch-size "$BATCH" --log-interval 0 \
    --results-json "$SCRATCH/ours.json" | tee "$SCRATCH/ours.log"
END=$(date +%s.%N)

"$PYTHON" - "$SCRATCH" "$DATA" "$START" "$END" "$BATCH" "$ROOT/scripts/reference" "${SKIP_HF:-0}" <<'PY'
import json, math, sys, time
scratch, data, start, end, batch, reference, skip_hf = sys.argv[1:8]
batch = int(batch)
sys.path.insert(0, reference)
ours = json.load(open(f"{scratch}/ours.json"))
ours_total = float(end) - float(start)
print(f"megatron-rs: {ours['num_windows']} windows in {ours['scoring_seconds']:.1f} s scoring "
      f"({ours_total:.1f} s process start to exit): {ours['windows_per_second']:.1f} windows/s; "
      f"adjusted ppl {ours['adjusted_ppl']:.4f}")
if skip_hf == "1":
    sys.exit(0)

import torch
from tokenizers import Tokenizer
from eval_tasks_reference import detokenize, load, windows

t0 = time.perf_counter()
model = load(f"{scratch}/ckpt").to("cuda", torch.bfloat16).eval()
raw = open(f"{scratch}/wiki.test.tokens", "rb").read().decode("utf-8")
n_orig = len(raw.strip().split(" "))
tokens = Tokenizer.from_file(f"{data}/gpt2-tokenizer.json").encode(detokenize(raw)).ids
n, seq, stride, eod = len(tokens), 1024, 32, 50256
count = windows(n, seq, stride)
assert count == ours["num_windows"], (count, ours["num_windows"])
setup = time.perf_counter() - t0

def window(k):
    text = tokens[k * stride: k * stride + seq + 1]
    mask = [1] * len(text)
    text = text + [eod] * (seq + 1 - len(text))
    mask = (mask + [0] * (seq + 1 - len(mask)))[1:]
    if k:
        mask[: seq - stride] = [0] * (seq - stride)
    return text, mask

torch.cuda.synchronize()
t1 = time.perf_counter()
total = torch.zeros((), dtype=torch.float64, device="cuda")
with torch.no_grad():
    for b in range(0, count, batch):
        rows = [window(k) for k in range(b, min(b + batch, count))]
        text = torch.tensor([r[0] for r in rows], device="cuda")
        mask = torch.tensor([r[1] for r in rows], device="cuda", dtype=torch.float64)
        logits = model(text[:, :-1]).logits
        losses = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), text[:, 1:], reduction="none")
        total += (losses.double() * mask).sum()
torch.cuda.synchronize()
loop = time.perf_counter() - t1
avg = total.item() / (n - 1)
adjusted = math.exp(min(20, avg * (n - 1) / (n_orig - 1)))
print(f"HF (bf16, batch {batch}): {count} windows in {loop:.1f} s scoring + {setup:.1f} s set-up: "
      f"{count / loop:.1f} windows/s; adjusted ppl {adjusted:.4f}")
print(f"speed-up, scoring loops: {ours['windows_per_second'] / (count / loop):.2f}x; "
      f"end to end (megatron-rs process vs HF set-up + loop): {(setup + loop) / ours_total:.2f}x")
PY
