#!/usr/bin/env bash
# Generation speed of text_generation_server against HuggingFace transformers' `generate` on the
# same GPU with the same weights: GPT 345M (GPT-2-medium shape: 24 layers, hidden 1024, 16 heads,
# learned positions, tied embeddings), bf16, greedy, prompts of 128 tokens, 256 new tokens, at
# batch 1 and batch 32. Reports new tokens/s and the time to the first token (a request with
# tokens_to_generate = 1) for both.
#
# The weights are a pretrain_gpt checkpoint after one step on mock data (NullTokenizer with
# GPT-2's 50257 ids, so prompts are token ids); scripts/bench/gpt_to_hf.py converts them for HF.
#
# Environment (all optional):
#   BIN=target/release   where pretrain_gpt and text_generation_server are [built here]
#   PYTHON=python3       a python with torch 2.11 (CUDA) and transformers for the reference
#   REPEATS=3            timed requests per measurement (the median is reported)
#   SERVER_FLAGS=        extra text_generation_server flags, e.g. --no-cuda-graphs
#   SKIP_HF=1            measure only megatron-rs
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
if [[ -z "${BIN:-}" ]]; then
    (cd "$ROOT" && cargo build --release --quiet -p pretrain_gpt -p text_generation_server)
    BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release"
fi
# shellcheck source=../torch-env.sh
source "$ROOT/scripts/torch-env.sh" "$PYTHON"
SCRATCH="$(mktemp -d -t generate-bench.XXXXXX)"
SERVER=""
trap '[[ -n "$SERVER" ]] && kill "$SERVER" 2>/dev/null; rm -rf "$SCRATCH"' EXIT

SHAPE=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024)
TOKENIZER=(--tokenizer-type NullTokenizer --vocab-size 50256)
echo "== checkpoint" >&2
"$BIN/pretrain_gpt" "${SHAPE[@]}" "${TOKENIZER[@]}" --micro-batch-size 1 --global-batch-size 1 --train-iters 1 \
    --lr 1e-4 --bf16 --mock-data --eval-iters 0 --save "$SCRATCH/ckpt" >"$SCRATCH/train.log" 2>&1 \
    || { tail -20 "$SCRATCH/train.log" >&2; exit 1; }

PORT="${PORT:-5123}"
"$BIN/text_generation_server" --load "$SCRATCH/ckpt" "${TOKENIZER[@]}" --port "$PORT" --bf16 --max-tokens-to-oom 100000 ${SERVER_FLAGS:-} >"$SCRATCH/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 600); do
    grep -q "serving" "$SCRATCH/server.log" && break
    kill -0 "$SERVER" 2>/dev/null || { cat "$SCRATCH/server.log" >&2; exit 1; }
    sleep 0.1
done

"$PYTHON" - "$SCRATCH" "$PORT" "${REPEATS:-3}" "$ROOT/scripts/bench/gpt_to_hf.py" "${SKIP_HF:-0}" <<'PY'
import json, statistics, sys, time, urllib.request, importlib.util
scratch, port, repeats, converter = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
skip_hf = sys.argv[5] == "1"
PROMPT, NEW = 128, 256

def prompt(row):
    return " ".join(str((row * 7919 + i * 104729) % 50000) for i in range(PROMPT))

def ours(batch, new):
    body = json.dumps({"prompts": [prompt(r) for r in range(batch)], "tokens_to_generate": new,
                       "top_k": 1, "no_log": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/api", data=body, method="PUT",
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    reply = json.load(urllib.request.urlopen(request))
    elapsed = time.perf_counter() - start
    generated = sum(len(s) - PROMPT for s in reply["segments"])
    return elapsed, generated

def measure(run, batch):
    run(batch, 4)  # warm-up
    ttft = statistics.median(run(batch, 1)[0] for _ in range(repeats))
    timed = [run(batch, NEW) for _ in range(repeats)]
    elapsed = statistics.median(t for t, _ in timed)
    generated = timed[0][1]
    return generated / elapsed, ttft, generated

results = {}
for batch in (1, 32):
    results[("ours", batch)] = measure(ours, batch)
    print(f"ours batch {batch}: {results[('ours', batch)]}", file=sys.stderr)

hf_error = "SKIP_HF=1" if skip_hf else None
try:
    if skip_hf:
        raise RuntimeError("skipped")
    import torch
    spec = importlib.util.spec_from_file_location("gpt_to_hf", converter)
    gpt_to_hf = importlib.util.module_from_spec(spec); spec.loader.exec_module(gpt_to_hf)
    model = gpt_to_hf.load(f"{scratch}/ckpt").to("cuda", torch.bfloat16).eval()

    def hf(batch, new):
        ids = torch.tensor([[int(t) for t in prompt(r).split()] for r in range(batch)], device="cuda")
        torch.cuda.synchronize(); start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, pad_token_id=50256)
        torch.cuda.synchronize()
        return time.perf_counter() - start, (out.shape[1] - PROMPT) * batch

    for batch in (1, 32):
        results[("hf", batch)] = measure(hf, batch)
        print(f"hf batch {batch}: {results[('hf', batch)]}", file=sys.stderr)
except Exception as e:  # the reference needs transformers
    hf_error = hf_error or f"{type(e).__name__}: {e}"

print(f"{'':22} {'new tokens/s':>14} {'time to first token':>20}")
for batch in (1, 32):
    for who in ("ours", "hf"):
        if (who, batch) in results:
            rate, ttft, _ = results[(who, batch)]
            name = "megatron-rs" if who == "ours" else "HF transformers"
            print(f"{name + f' batch {batch}':22} {rate:14,.0f} {ttft * 1000:17.1f} ms")
    if ("hf", batch) in results:
        print(f"{'speed-up batch ' + str(batch):22} {results[('ours', batch)][0] / results[('hf', batch)][0]:13.1f}x")
if hf_error:
    print(f"HF reference not run: {hf_error}")
PY
