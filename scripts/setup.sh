#!/usr/bin/env bash
# Idempotent set-up for building megatron-rs: checks the toolchain and points `.libtorch` (read by
# .cargo/config.toml) at a libtorch of the 2.11 series, which tch 0.24 binds. Sources, in order:
#   LIBTORCH=/path/to/libtorch     a C++ libtorch distribution, or a python torch package directory
#   TORCH_PYTHON=/path/to/python   an existing python environment with torch 2.11
#   python3 on PATH                if its torch is 2.11 (no download needed)
#   otherwise                      a project-local venv (.venv) with torch==2.11.0 from PyPI
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

REQUIRED_TORCH=2.11.0
SERIES=2.11

log() { echo "setup: $*" >&2; }
die() { echo "setup: error: $*" >&2; exit 1; }

command -v cargo >/dev/null || die "cargo not found: install a Rust toolchain (https://rustup.rs)"
command -v c++ >/dev/null || command -v g++ >/dev/null || die "no C++ compiler found: install g++ (the autograd shim is C++)"

# Version of a libtorch directory: `build-version` in C++ distributions, `version.py` in wheels.
libtorch_version() {
  if [ -f "$1/build-version" ]; then
    tr -d '[:space:]' <"$1/build-version"
  elif [ -f "$1/version.py" ]; then
    sed -n "s/^__version__ = '\(.*\)'$/\1/p" "$1/version.py"
  fi
}

# Fails unless $1 is a libtorch of the supported series; $2 names where it came from.
check_libtorch() {
  local dir=$1 origin=$2 version
  [ -d "$dir/lib" ] && [ -d "$dir/include" ] || die "$origin: $dir has no lib/ and include/; it is not a libtorch"
  version=$(libtorch_version "$dir")
  case "$version" in
    "$SERIES".*) log "using libtorch $version from $origin: $dir" ;;
    "") die "$origin: cannot read the torch version of $dir (no build-version or version.py)" ;;
    *) die "$origin: $dir is torch $version, but megatron-rs needs torch $SERIES.x (tch 0.24 binds libtorch $REQUIRED_TORCH). Install torch==$REQUIRED_TORCH or unset $origin to let this script make a venv." ;;
  esac
}

python_torch_dir() {
  "$1" -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null
}

if [ -n "${LIBTORCH:-}" ]; then
  check_libtorch "$LIBTORCH" LIBTORCH
  target=$LIBTORCH
elif [ -n "${TORCH_PYTHON:-}" ]; then
  target=$(python_torch_dir "$TORCH_PYTHON") || die "TORCH_PYTHON=$TORCH_PYTHON cannot import torch"
  check_libtorch "$target" TORCH_PYTHON
elif [ ! -d .venv ] && target=$(python_torch_dir python3) && [[ $(libtorch_version "$target") == "$SERIES".* ]]; then
  check_libtorch "$target" "python3 on PATH"
else
  command -v python3 >/dev/null || die "python3 not found: it is needed to install torch==$REQUIRED_TORCH into .venv"
  if [ ! -x .venv/bin/python ]; then
    log "creating the project venv .venv"
    python3 -m venv .venv || die "python3 -m venv failed (on Debian/Ubuntu: apt-get install python3-venv)"
  fi
  installed=$(.venv/bin/python -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
  if [[ $installed != "$SERIES".* ]]; then
    log "installing torch==$REQUIRED_TORCH into .venv from PyPI (about 3 GB with its CUDA libraries)"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==$REQUIRED_TORCH" \
      || die "pip could not install torch==$REQUIRED_TORCH"
  fi
  target=$(python_torch_dir .venv/bin/python) || die ".venv cannot import torch after installing it"
  check_libtorch "$target" ".venv"
  # The CUDA wheels ship cuda_runtime.h without the crt/ headers it includes; the autograd shim
  # needs both for CUDA graphs (text generation decodes several times faster with them).
  cuda_include=$target/../nvidia/cu13/include
  if [ -f "$cuda_include/cuda_runtime.h" ] && [ ! -f "$cuda_include/crt/host_config.h" ]; then
    toolkit=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("cuda-toolkit"))' 2>/dev/null) \
      || die "torch's CUDA wheels are there but cuda-toolkit's version cannot be read"
    log "installing the CUDA runtime's crt headers (cuda-toolkit[crt]==$toolkit) for CUDA graphs"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check "cuda-toolkit[crt]==$toolkit" \
      || die "pip could not install cuda-toolkit[crt]==$toolkit"
  fi
fi

# The link names the real directory: LIBTORCH may itself be this checkout's .libtorch.
target=$(cd "$target" && pwd -P)
ln -sfn "$target" .libtorch
log "ready: .libtorch -> $target"
