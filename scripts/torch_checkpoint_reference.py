"""Reference reader for tests: what PyTorch itself reads from a checkpoint file or directory.

    torch_checkpoint_reference.py FILE.pt     torch.load(weights_only=False), Megatron classes stubbed
    torch_checkpoint_reference.py DIST_DIR    torch.distributed.checkpoint, every tensor whole

Prints JSON: {"tensors": {path: [dtype, shape, md5 of the C-order bytes]}, "scalars": {...},
"args": {...}, "model_keys": [the model state dict's keys in order], "param_groups": [the optimizer's
param groups, tensors left out]}. Paths join dict keys and list indices with "/". For a DIST_DIR
also "dist_metadata": {key: [dtype, size, sorted [offsets, sizes] chunks] or "bytes"} (as
read_metadata() reads .metadata) and "common_paths": {path: type name} of common.pt's entries
(args left out).
"""
import hashlib
import json
import os
import pickle
import sys
import types

import torch


class _Stub:
    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module.startswith("megatron"):
            return type(name, (_Stub,), {})
        return super().find_class(module, name)


stub_pickle = types.ModuleType("stub_pickle")
stub_pickle.Unpickler = _Unpickler
stub_pickle.load = pickle.load
stub_pickle.__name__ = "pickle"


def digest(tensor):
    t = tensor.detach().contiguous()
    raw = t.view(torch.uint8) if t.dim() > 0 else t.reshape(1).view(torch.uint8)
    return hashlib.md5(raw.numpy().tobytes()).hexdigest()


def walk(value, path, out):
    if isinstance(value, torch.Tensor):
        out[path] = [str(value.dtype).replace("torch.", ""), list(value.shape), digest(value)]
    elif isinstance(value, dict):
        for k, v in value.items():
            walk(v, f"{path}/{k}" if path else str(k), out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            walk(v, f"{path}/{i}" if path else str(i), out)


def plain(value):
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return None


def main(path):

    if os.path.isdir(path):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        reader = dcp.FileSystemReader(path)
        metadata = reader.read_metadata()
        state = {k: torch.empty(m.size, dtype=m.properties.dtype)
                 for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
        dcp.load(state, storage_reader=reader, no_dist=True)
        root = torch.load(os.path.join(path, "common.pt"), map_location="cpu", weights_only=False,
                          pickle_module=stub_pickle)
        tensors = {}
        walk(state, "", tensors)
        dist_metadata = {
            k: [str(m.properties.dtype).replace("torch.", ""), list(m.size),
                sorted([list(c.offsets), list(c.sizes)] for c in m.chunks)]
            if isinstance(m, TensorStorageMetadata) else "bytes"
            for k, m in metadata.state_dict_metadata.items()}
    else:
        root = torch.load(path, map_location="cpu", weights_only=False, pickle_module=stub_pickle)
        tensors = {}
        walk(root, "", tensors)
    scalars = {k: plain(v) for k, v in root.items() if isinstance(v, (int, float, str))} if isinstance(root, dict) else {}
    args = root.get("args") if isinstance(root, dict) else None
    args = {k: plain(v) for k, v in vars(args).items()} if args is not None else {}
    model_keys = list(root["model"].keys()) if isinstance(root, dict) and "model" in root else []
    optimizer = root.get("optimizer") if isinstance(root, dict) else None
    if isinstance(optimizer, dict) and "optimizer" in optimizer:
        optimizer = optimizer["optimizer"]
    groups = optimizer.get("param_groups", []) if isinstance(optimizer, dict) else []
    param_groups = [{k: plain(v) for k, v in g.items()} for g in groups]
    result = {"tensors": tensors, "scalars": scalars, "args": args, "model_keys": model_keys,
              "param_groups": param_groups}
    if os.path.isdir(path):
        result["dist_metadata"] = dist_metadata
        result["common_paths"] = paths({k: v for k, v in root.items() if k != "args"}, "")
    json.dump(result, sys.stdout)


def paths(value, path):
    """Every entry of nested dicts and lists by path, with its type's name."""
    out = {path: type(value).__name__} if path else {}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else []
    for k, v in items:
        out.update(paths(v, f"{path}/{k}" if path else str(k)))
    return out


if __name__ == "__main__":
    main(sys.argv[1])
