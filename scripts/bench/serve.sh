#!/usr/bin/env bash
# Serving many users: text_generation_server with continuous batching against the same binary
# serving one request at a time (--max-batch-size 1, what the server did before batching), on
# one GPU with GPT 345M (GPT-2-medium shape: 24 layers, hidden 1024, 16 heads), bf16. 64
# concurrent clients stream greedy OpenAI completions, prompts of 32-512 tokens, 64-512 new
# tokens (scripts/bench/serve_load.py; the same requests for every server). Reports aggregate
# new tokens/s and p50/p99 time to first token and per-token latency for each, and batch-1
# decode tokens/s of each batching server (one request alone: prompt 128, 256 new tokens,
# through PUT /api).
#
# The weights are a pretrain_gpt checkpoint after one step on mock data (NullTokenizer with
# GPT-2's 50257 ids, so prompts are token ids). Time to first token and per-token latency are
# measured on the streamed events, so they are only as good as the HTTP layer's flushing of
# them; aggregate tokens/s does not depend on it.
#
# Environment (all optional):
#   BIN=target/release   where pretrain_gpt and text_generation_server are [built here]
#   PYTHON=python3       runs the load generator (standard library only) and finds torch
#   REQUESTS=256         requests of the batching run
#   SERIAL_REQUESTS=48   requests of the one-at-a-time run (its rate needs fewer)
#   CLIENTS=64           concurrent clients
#   SERVER_FLAGS=        extra text_generation_server flags for every run, e.g. --kv-cache-gb 8
#   VARIANTS=            ';'-separated flag sets, each one more continuous-batching run (batch-1
#                        decode included) in the same table, e.g.
#                        VARIANTS="--no-paged-attention;--no-decode-fusion;--prefill-chunk-size 2048";
#                        NAME=value words go to the server's environment, e.g.
#                        "MEGATRON_RS_DECODE_CACHED_WEIGHTS=0" (every decode weight streamed)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
if [[ -z "${BIN:-}" ]]; then
    (cd "$ROOT" && cargo build --release --quiet -p pretrain_gpt -p text_generation_server)
    BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release"
fi
# shellcheck source=../torch-env.sh
source "$ROOT/scripts/torch-env.sh" "$PYTHON"
# shellcheck source=ours_variants.sh
source "$ROOT/scripts/bench/ours_variants.sh"
SCRATCH="$(mktemp -d -t serve-bench.XXXXXX)"
SERVER=""
trap '[[ -n "$SERVER" ]] && kill "$SERVER" 2>/dev/null; rm -rf "$SCRATCH"' EXIT

SHAPE=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024)
TOKENIZER=(--tokenizer-type NullTokenizer --vocab-size 50256)
echo "== checkpoint" >&2
"$BIN/pretrain_gpt" "${SHAPE[@]}" "${TOKENIZER[@]}" --micro-batch-size 1 --global-batch-size 1 --train-iters 1 \
    --lr 1e-4 --bf16 --mock-data --eval-iters 0 --save "$SCRATCH/ckpt" >"$SCRATCH/train.log" 2>&1 \
    || { tail -20 "$SCRATCH/train.log" >&2; exit 1; }

PORT="${PORT:-5123}"
# Starts the server with extra flags "$@" and waits until it serves.
# The server runs with $SERVER_ENV (NAME=value words) in its environment.
SERVER_ENV=()
start_server() {
    env "${SERVER_ENV[@]}" "$BIN/text_generation_server" --load "$SCRATCH/ckpt" "${TOKENIZER[@]}" --port "$PORT" --bf16 \
        --max-tokens-to-oom 100000 "$@" ${SERVER_FLAGS:-} >"$SCRATCH/server.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 600); do
        grep -q "serving" "$SCRATCH/server.log" && return 0
        kill -0 "$SERVER" 2>/dev/null || { cat "$SCRATCH/server.log" >&2; exit 1; }
        sleep 0.1
    done
    echo "the server did not start" >&2; exit 1
}
stop_server() {
    kill "$SERVER"; wait "$SERVER" || true; SERVER=""
}
LOAD=("$PYTHON" "$ROOT/scripts/bench/serve_load.py" --port "$PORT" --clients "${CLIENTS:-64}"
      --prompt-tokens 32 512 --new-tokens 64 512 --vocab 50000 --seed 1)

# Batch-1 decode: one request alone (prompt 128, 256 new tokens, greedy), median of 3.
batch1() {
    "$PYTHON" - "$PORT" <<'PY'
import json, statistics, sys, time, urllib.request
port = int(sys.argv[1])
def once(new):
    prompt = " ".join(str((i * 104729) % 50000) for i in range(128))
    body = json.dumps({"prompts": [prompt], "tokens_to_generate": new, "top_k": 1, "no_log": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/api", data=body, method="PUT",
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    json.load(urllib.request.urlopen(request))
    return time.perf_counter() - start
once(8)
first = statistics.median(once(1) for _ in range(3))
full = statistics.median(once(256) for _ in range(3))
print(json.dumps({"decode_tokens_per_s": 255 / (full - first)}))
PY
}

# One continuous-batching run per flag set: the default, then each of $VARIANTS.
IFS=';' read -r -a variants <<<"${VARIANTS:-}"
runs=("")
for v in "${variants[@]}"; do [[ -n "${v// }" ]] && runs+=("$v"); done
: >"$SCRATCH/runs.txt"
for i in "${!runs[@]}"; do
    flags="${runs[$i]}"
    echo "== continuous batching ${flags:-(default)}" >&2
    split_variant "$flags"
    SERVER_ENV=("${VARIANT_ENV[@]}")
    start_server "${VARIANT_FLAGS[@]}"
    SERVER_ENV=()
    batch1 >"$SCRATCH/batch1_$i.json"
    "${LOAD[@]}" --requests "${REQUESTS:-256}" --json "$SCRATCH/batched_$i.json"
    grep -E "graph|KV|warning" "$SCRATCH/server.log" >&2 || true
    stop_server
    printf '%s\t%s\n' "$i" "$flags" >>"$SCRATCH/runs.txt"
done
echo "== one request at a time (--max-batch-size 1)" >&2
start_server --max-batch-size 1
"${LOAD[@]}" --requests "${SERIAL_REQUESTS:-48}" --json "$SCRATCH/serial.json"
stop_server

"$PYTHON" - "$SCRATCH" <<'PY'
import json, sys
scratch = sys.argv[1]
runs = []
for line in open(f"{scratch}/runs.txt"):
    index, _, flags = line.rstrip("\n").partition("\t")
    label = "continuous batching" + (f" {flags}" if flags else "")
    runs.append((label, json.load(open(f"{scratch}/batched_{index}.json")),
                 json.load(open(f"{scratch}/batch1_{index}.json"))))
serial = json.load(open(f"{scratch}/serial.json"))
width = max(26, *(len(label) for label, _, _ in runs))
print(f"{'':{width}} {'requests':>8} {'new tokens/s':>13} {'TTFT p50':>10} {'TTFT p99':>10} {'token p50':>10} {'token p99':>10} {'batch-1':>9}")
def row(label, r, batch1=None):
    b1 = f"{batch1['decode_tokens_per_s']:9,.0f}" if batch1 else f"{'':9}"
    print(f"{label:{width}} {r['requests']:8d} {r['tokens_per_s']:13,.0f} {r['ttft_p50_ms']:8.0f}ms {r['ttft_p99_ms']:8.0f}ms"
          f" {r['token_latency_p50_ms']:8.1f}ms {r['token_latency_p99_ms']:8.1f}ms {b1}")
for label, r, batch1 in runs:
    row(label, r, batch1)
row("one at a time", serial)
for label, r, _ in runs:
    print(f"{label}: aggregate speed-up {r['tokens_per_s'] / serial['tokens_per_s']:.1f}x over one at a time")
print("batch-1: decode tokens/s of one request alone (prompt 128, 256 new tokens)")
PY
