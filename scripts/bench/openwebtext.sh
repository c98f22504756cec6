#!/usr/bin/env bash
# Benchmark of `openwebtext_filter find-duplicates` against Megatron's find_duplicates.py.
#
# Builds a corpus from ../shared/data (WikiText, Shakespeare, LAMBADA passages) with injected
# edited copies, runs our dedup step, and — when Megatron's script and mattilyra's LSH package
# can be installed into a venv under target/bench-openwebtext — the original on the same input.
# Reports documents/s of both, the overlap of the duplicate pairs at the 0.5 threshold, and the
# recall of the injected pairs against their exact Jaccard (computed here in Python).
#
# Usage: scripts/bench/openwebtext.sh [num_docs (default 10000; each source text is used once)]
set -euo pipefail
cd "$(dirname "$0")/../.."
NUM_DOCS=${1:-10000}
SHARED=${MEGATRON_RS_SHARED:-../shared}
TARGET=${CARGO_TARGET_DIR:-target}
WORK=target/bench-openwebtext
mkdir -p "$WORK"

cargo build --release -p openwebtext_filter
BIN="$TARGET/release/openwebtext_filter"

python3 - "$SHARED/data" "$WORK/docs.json" "$WORK/injected.json" "$NUM_DOCS" <<'PY'
import json, random, sys
data, out, injected_out, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
texts = []
for name in ["wikitext103_valid.jsonl", "wikitext103_test.jsonl", "lambada_test.jsonl", "tinyshakespeare.jsonl"]:
    for line in open(f"{data}/{name}", encoding="utf-8"):
        t = json.loads(line)["text"]
        # Long articles are cut into 2000-character documents.
        for i in range(0, len(t), 2000):
            if len(t[i:i+2000]) > 200:
                texts.append(t[i:i+2000])
rng = random.Random(1234)
rng.shuffle(texts)
docs, injected = [], []
while len(docs) < n and texts:
    if rng.random() < 0.1 and docs:
        src_id, src = rng.choice(docs)
        words = src.split(" ")
        every = rng.choice([10, 20, 50])
        copy = " ".join("edit" if i % every == 0 else w for i, w in enumerate(words))
        doc_id = f"doc{len(docs)}"
        injected.append((src_id, doc_id))
        docs.append((doc_id, copy))
    else:
        docs.append((f"doc{len(docs)}", texts.pop()))
print(f"corpus: {len(docs)} documents, {len(injected)} injected edited copies")
with open(out, "w", encoding="utf-8") as f:
    for doc_id, text in docs:
        f.write(json.dumps({"text": text, "url": doc_id}, ensure_ascii=False) + "\n")
def grams(t):
    return {t[i:i+5] for i in range(len(t) - 4)}
text_of = dict(docs)
truth = []
for a, b in injected:
    ga, gb = grams(text_of[a]), grams(text_of[b])
    truth.append([a, b, len(ga & gb) / len(ga | gb)])
json.dump(truth, open(injected_out, "w"))
PY

pairs_of() {
python3 - "$1" <<'PY'
import json, sys
pairs = set()
for line in open(sys.argv[1], encoding="utf-8"):
    for main, others in json.loads(line).items():
        for o in others:
            for other in o:
                pairs.add(tuple(sorted((main, other))))
json.dump(sorted(pairs), sys.stdout)
PY
}

start=$(date +%s.%N)
"$BIN" find-duplicates --inputs "$WORK/docs.json" url --output "$WORK/ours.json"
end=$(date +%s.%N)
ours_s=$(awk -v a="$start" -v b="$end" 'BEGIN { print b - a }')
NUM_DOCS=$(wc -l < "$WORK/docs.json")
echo "ours: $NUM_DOCS docs in ${ours_s}s = $(awk -v n="$NUM_DOCS" -v t="$ours_s" 'BEGIN { printf "%d", n / t }') docs/s"
pairs_of "$WORK/ours.json" > "$WORK/ours_pairs.json"

python3 - "$WORK/injected.json" "$WORK/ours_pairs.json" <<'PY'
import json, sys
truth = json.load(open(sys.argv[1]))
ours = {tuple(p) for p in json.load(open(sys.argv[2]))}
similar = [(a, b, j) for a, b, j in truth if j > 0.5]
found = sum(1 for a, b, _ in similar if tuple(sorted((a, b))) in ours)
print(f"injected pairs with exact Jaccard > 0.5: {len(similar)}; found by ours: {found} "
      f"({100.0 * found / max(1, len(similar)):.1f}%); pairs reported in total: {len(ours)}")
PY

# The reference: Megatron's script (tag core_v0.12.0) and mattilyra/LSH, installed at bench time.
# Without network to GitHub: MEGATRON_LM=<a Megatron-LM checkout> gives the script and
# LSH_SOURCE=<a mattilyra/LSH checkout at a57069b> the package, built here (its shipped C++ is
# generated for Python < 3.11, so it is regenerated with Cython < 3).
VENV="$WORK/venv"
REF="$WORK/find_duplicates.py"
if [ ! -f "$REF" ]; then
    if [ -n "${MEGATRON_LM:-}" ]; then
        cp "$MEGATRON_LM/tools/openwebtext/find_duplicates.py" "$REF"
    else
        curl -fsSL -o "$REF" \
            https://raw.githubusercontent.com/NVIDIA/Megatron-LM/core_v0.12.0/tools/openwebtext/find_duplicates.py \
            || { rm -f "$REF"; echo "reference: cannot download Megatron's find_duplicates.py (set MEGATRON_LM); only the exact-Jaccard check above ran"; exit 0; }
    fi
fi
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "from lsh import minhash" 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q numpy "cython<3" wheel setuptools
    if [ -n "${LSH_SOURCE:-}" ]; then
        rm -rf "$WORK/lsh-src" && cp -r "$LSH_SOURCE" "$WORK/lsh-src"
        "$VENV/bin/cython" --cplus "$WORK/lsh-src/lsh/cMinhash.pyx" -o "$WORK/lsh-src/lsh/cMinhash.cpp"
        "$VENV/bin/pip" install -q --no-build-isolation "$WORK/lsh-src"
    else
        "$VENV/bin/pip" install -q --no-build-isolation "git+https://github.com/mattilyra/LSH@a57069b"
    fi || { echo "reference: cannot install mattilyra/LSH (set LSH_SOURCE); only the exact-Jaccard check above ran"; exit 0; }
fi
start=$(date +%s.%N)
"$VENV/bin/python" "$REF" --inputs "$WORK/docs.json" url --output "$WORK/megatron.json" > "$WORK/megatron.log"
end=$(date +%s.%N)
ref_s=$(awk -v a="$start" -v b="$end" 'BEGIN { print b - a }')
echo "megatron: $NUM_DOCS docs in ${ref_s}s = $(awk -v n="$NUM_DOCS" -v t="$ref_s" 'BEGIN { printf "%d", n / t }') docs/s; speed-up $(awk -v r="$ref_s" -v o="$ours_s" 'BEGIN { printf "%.1f", r / o }')x"
pairs_of "$WORK/megatron.json" > "$WORK/megatron_pairs.json"
python3 - "$WORK/ours_pairs.json" "$WORK/megatron_pairs.json" <<'PY'
import json, sys
ours = {tuple(p) for p in json.load(open(sys.argv[1]))}
ref = {tuple(p) for p in json.load(open(sys.argv[2]))}
both = ours & ref
print(f"pairs: ours {len(ours)}, megatron {len(ref)}, both {len(both)}, "
      f"overlap (Jaccard of pair sets) {len(both) / max(1, len(ours | ref)):.3f}")
PY
