#!/usr/bin/env bash
# Library path for megatron-rs binaries on a machine other than the one that built them (their
# rpath points at the builder's libtorch). Finds torch 2.11 from $LIBTORCH, from the python given
# as $1 (default: python3), or from this checkout's .libtorch, and adds libtorch's directory plus
# the NVIDIA wheels' NCCL and CUDA libraries, so that NCCL is the same libnccl.so.2 libtorch uses.
# The NCCL backend loads NCCL by the name `libnccl.so` (cudarc's dlopen), which the wheel lacks: a
# directory under ${XDG_CACHE_HOME:-~/.cache}/megatron-rs/, named after the file's device and
# inode, gets a `libnccl.so` symlink to libtorch's libnccl.so.2 and goes first on the path, so the
# dynamic loader finds the file it already loaded and the process keeps one NCCL.
#
#   source scripts/torch-env.sh [PYTHON]    # sets LD_LIBRARY_PATH in this shell
#   scripts/torch-env.sh [PYTHON]           # prints the export line
_mrs_torch_env() {
  local python=${1:-python3} torch_dir="" dirs="" d nccl link_dir
  if [ -n "${LIBTORCH:-}" ]; then
    torch_dir=$LIBTORCH
  elif torch_dir=$("$python" -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null); then
    :
  else
    torch_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && readlink -f .libtorch 2>/dev/null) || torch_dir=""
  fi
  if [ -z "$torch_dir" ] || [ ! -d "$torch_dir/lib" ]; then
    echo "torch-env: no torch found (set LIBTORCH, pass a python with torch 2.11, or run scripts/setup.sh)" >&2
    return 1
  fi
  dirs=$torch_dir/lib
  for nccl in "$torch_dir"/../nvidia/nccl/lib/libnccl.so.2 "$torch_dir"/lib/libnccl.so.2; do
    [ -f "$nccl" ] || continue
    nccl=$(readlink -f "$nccl")
    link_dir=${XDG_CACHE_HOME:-$HOME/.cache}/megatron-rs/nccl-$(stat -L -c %d-%i "$nccl")
    if mkdir -p "$link_dir" && ln -sfn "$nccl" "$link_dir/libnccl.so"; then
      dirs=$link_dir:$dirs
    else
      echo "torch-env: cannot make the symlink $link_dir/libnccl.so -> $nccl;" \
        "the NCCL backend will not load" >&2
    fi
    break
  done
  for d in "$torch_dir"/../nvidia/nccl/lib "$torch_dir"/../nvidia/cu13/lib "$torch_dir"/../nvidia/*/lib; do
    [ -d "$d" ] || continue
    d=$(readlink -f "$d")
    case ":$dirs:" in *":$d:"*) ;; *) dirs=$dirs:$d ;; esac
  done
  echo "export LD_LIBRARY_PATH=$dirs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  _mrs_torch_env "$@"
else
  _mrs_line=$(_mrs_torch_env "$@") && eval "$_mrs_line"
  unset _mrs_line
fi
