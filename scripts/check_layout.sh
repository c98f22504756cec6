#!/usr/bin/env bash
# Checks the workspace's layering (ARCHITECTURE.md): every library crate depends only on crates
# of lower floors, no two modules of a crate import each other in a circle, the data-side crates
# never link libtorch, and the training binaries link neither the inference engine nor the HTTP
# stack. scripts/test.sh runs it before building.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# No import circles between the modules of a crate.
python3 scripts/module_cycles.py

metadata=$(mktemp)
trap 'rm -f "$metadata"' EXIT
host=$(rustc -vV | sed -n 's/^host: //p')
cargo metadata --locked --format-version 1 --filter-platform "$host" >"$metadata"

python3 - "$metadata" <<'EOF'
import json
import sys

# Floor of each library crate: a crate depends on crates of lower floors only.
FLOORS = {
    "megatron-data": 0, "megatron-checkpoint": 0, "megatron-cli": 0,
    "megatron-kernels": 1,
    "megatron-parallel": 2,
    "megatron-models": 3,
    "megatron-store": 4, "megatron-optim": 4,
    "megatron-training": 5, "megatron-convert": 5,
    "megatron-inference": 6,
    "megatron-serving": 7,
}
# Crates no library of the data side may reach, and what the training binaries may not link.
LIBTORCH = {"tch", "torch-sys"}
NOT_IN_TRAINING = {"megatron-inference", "megatron-serving", "tokio", "hyper", "minijinja"}

metadata = json.load(open(sys.argv[1]))
names = {p["id"]: p["name"] for p in metadata["packages"]}
members = {names[i] for i in metadata["workspace_members"]}
normal = {}
for node in metadata["resolve"]["nodes"]:
    normal[names[node["id"]]] = {
        names[d["pkg"]]
        for d in node["deps"]
        if any(k["kind"] in (None, "build") for k in d["dep_kinds"])
    }

def reach(name):
    seen, todo = set(), [name]
    while todo:
        for dep in normal[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen

errors = []
for crate in sorted(members):
    if not crate.startswith("megatron-") or crate == "megatron-e2e":
        continue
    if crate not in FLOORS:
        errors.append(f"{crate} has no floor: add it to scripts/check_layout.sh and ARCHITECTURE.md")
        continue
    for dep in sorted(d for d in normal[crate] if d in FLOORS):
        if FLOORS[dep] >= FLOORS[crate]:
            errors.append(
                f"{crate} (floor {FLOORS[crate]}) depends on {dep} (floor {FLOORS[dep]}): "
                "dependencies run down the floors only"
            )
for crate in ("megatron-data", "megatron-checkpoint", "megatron-cli"):
    if reach(crate) & LIBTORCH:
        errors.append(f"{crate} depends on libtorch")
for binary in ("pretrain_gpt", "pretrain_bert", "pretrain_t5"):
    for unwanted in sorted(reach(binary) & NOT_IN_TRAINING):
        errors.append(f"{binary} links {unwanted}")

for error in errors:
    print(f"check_layout: error: {error}", file=sys.stderr)
if errors:
    sys.exit(1)
print("check_layout: dependencies run down the floors, no import circles, no HTTP stack in training",
      file=sys.stderr)
EOF
