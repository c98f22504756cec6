"""Load generator for text_generation_server: CLIENTS concurrent clients send streamed OpenAI
completions (prompts of random token ids, greedy) until REQUESTS have been answered, and the
run reports aggregate new tokens/s and p50/p99 time to first token and per-token latency.

    python3 serve_load.py --port 5000 --clients 64 --requests 256 \
        --prompt-tokens 32 512 --new-tokens 64 512 --seed 1 [--json out.json]

Prompts are space-separated ids (a NullTokenizer server). The workload depends only on --seed,
so two servers see the same requests in the same order. Standard library only.
"""

import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time


def percentile(values, q):
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def workload(args):
    rng = random.Random(args.seed)
    jobs = []
    for _ in range(args.requests):
        length = rng.randint(*args.prompt_tokens)
        prompt = " ".join(str(rng.randrange(args.vocab)) for _ in range(length))
        jobs.append((prompt, rng.randint(*args.new_tokens)))
    return jobs


def stream_one(host, port, prompt, max_tokens, timeout):
    """One streamed completion: (time to first token, time of the first and the last token,
    tokens)."""
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True})
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    start = time.perf_counter()
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
    arrivals, tokens, last = [], None, None
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            last = time.perf_counter()
            break
        event = json.loads(data)
        if "usage" in event and event["usage"]:
            tokens = event["usage"]["completion_tokens"]
        elif event.get("choices") and event["choices"][0].get("text"):
            arrivals.append(time.perf_counter())
    connection.close()
    if not arrivals:
        raise RuntimeError("no tokens streamed")
    tokens = tokens if tokens is not None else len(arrivals)
    return arrivals[0] - start, (arrivals[0], last or arrivals[-1]), tokens


def run(args):
    jobs = workload(args)
    lock = threading.Lock()
    results, errors = [], []
    next_job = [0]

    def client(index):
        # Clients start spread over --ramp seconds, as users do.
        time.sleep(args.ramp * index / max(1, args.clients))
        while True:
            with lock:
                if next_job[0] >= len(jobs):
                    return
                prompt, new = jobs[next_job[0]]
                next_job[0] += 1
            try:
                result = stream_one(args.host, args.port, prompt, new, args.timeout)
                with lock:
                    results.append(result)
            except Exception as e:  # reported, not fatal: the summary counts them
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    ttft = [r[0] for r in results]
    # From the first token to the end of the stream: robust to a server that sends in bursts.
    per_token = [(r[1][1] - r[1][0]) / (r[2] - 1) for r in results if r[2] > 1]
    tokens = sum(r[2] for r in results)
    return {
        "requests": len(results),
        "errors": len(errors),
        "first_errors": errors[:3],
        "seconds": elapsed,
        "new_tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "ttft_p50_ms": 1000 * percentile(ttft, 50),
        "ttft_p99_ms": 1000 * percentile(ttft, 99),
        "token_latency_p50_ms": 1000 * percentile(per_token, 50),
        "token_latency_p99_ms": 1000 * percentile(per_token, 99),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=[32, 512])
    parser.add_argument("--new-tokens", type=int, nargs=2, default=[64, 512])
    parser.add_argument("--vocab", type=int, default=50000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--ramp", type=float, default=1.0, help="seconds over which clients start")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", help="also write the summary here")
    args = parser.parse_args()
    summary = run(args)
    print(json.dumps(summary, indent=1), file=sys.stderr)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(summary, out)
    if summary["errors"]:
        sys.exit(f"{summary['errors']} requests failed, e.g. {summary['first_errors']}")


if __name__ == "__main__":
    main()
