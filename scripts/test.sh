#!/usr/bin/env bash
# Sets up (scripts/setup.sh), builds every binary, and runs every test of the workspace.
# Extra arguments go to `cargo test` (e.g. scripts/test.sh -p megatron-data).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

scripts/setup.sh

# Python references the tests run (TensorBoard reading our event files), kept in .venv. When
# set-up took torch from elsewhere there is no .venv yet: the one made here sees python3's
# packages, so a later set-up, which prefers an existing .venv, still finds the same torch.
if [ ! -x .venv/bin/python ]; then
  echo "test: creating .venv for the test requirements" >&2
  python3 -m venv --system-site-packages .venv \
    || { echo "test: error: python3 -m venv failed (on Debian/Ubuntu: apt-get install python3-venv)" >&2; exit 1; }
fi
# Installed again whenever the requirements change: the stamp holds the file last installed.
stamp=.venv/.test-requirements.installed
if ! cmp -s scripts/test-requirements.txt "$stamp"; then
  echo "test: installing scripts/test-requirements.txt into .venv" >&2
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -r scripts/test-requirements.txt \
    || { echo "test: error: pip could not install scripts/test-requirements.txt into .venv" >&2; exit 1; }
  cp scripts/test-requirements.txt "$stamp"
fi
export MEGATRON_RS_TEST_PYTHON=$PWD/.venv/bin/python
# Tests run side by side, many as jobs of several ranks, so every process shares the cores with
# others: libtorch's OpenMP threads (one per core in each process) would wait on each other
# (a tiny CPU step took 1.6 s instead of 16 ms on two busy cores). One each, as torchrun gives
# the ranks it starts.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# The layering: crates depend on lower floors only, no libtorch on the data side, no HTTP in
# the training binaries.
scripts/check_layout.sh

# The tests are built with the binaries so both resolve features alike: dev-dependencies
# (proptest) turn on features of shared crates (getrandom), and a plain `--bins` build would
# compile the whole workspace a second time for `cargo test`.
cargo build --locked --workspace --bins --tests
cargo test --locked --workspace "$@"
