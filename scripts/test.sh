#!/usr/bin/env bash
# Sets up (scripts/setup.sh), builds every binary, and runs every test of the workspace.
# Extra arguments go to `cargo test` (e.g. scripts/test.sh -p megatron-data).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

scripts/setup.sh

# The data crate and the data tools must never pull in libtorch.
if cargo tree --locked -p megatron-data -e normal,build --prefix none | grep -Eq '^(tch|torch-sys) '; then
  echo "test: error: megatron-data depends on libtorch" >&2
  exit 1
fi

cargo build --locked --workspace --bins
cargo test --locked --workspace "$@"
