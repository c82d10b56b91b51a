"""Checkpoints saved one tensor at a time, as torch_xla.utils.serialization: state larger than
half the host's memory can be saved, where `lazy_model.save` holds a CPU copy of all of it.

    serialization.save(model.state_dict(), "ckpt.pt")   # ckpt.pt + ckpt.pt.tensors/
    model.load_state_dict(serialization.load("ckpt.pt"))

`path` holds the structure (dicts, lists, numbers) with a reference where each tensor was;
`path.tensors/` holds one torch.save file per tensor. All pending values are computed in one
sync first; then each tensor is copied to the CPU, written and let go before the next, so the
peak is one tensor's copy above what the device holds. Both files load with torch.load's
`weights_only=True`: nothing but tensors and plain containers is unpickled.
"""
import os
import shutil
import tempfile

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..core import lazy_model

_SUFFIX = ".tensors"


class TensorReference:
    """Where a tensor was in the saved structure: the number of its file in `path.tensors/`."""

    def __init__(self, tid: int):
        self.tid = tid

    def __repr__(self):
        return f"TensorReference({self.tid})"


def _tensor_file(directory: str, tid: int) -> str:
    return os.path.join(directory, f"tensor_{tid}.pt")


def save(data, path: str):
    """Save `data` (tensors, lazy or CPU, in nested lists, tuples and dicts) to `path` and
    `path.tensors/`, one tensor on the CPU at a time; returns None. A tensor that appears twice
    is written once and loads as one tensor."""
    path = os.fspath(path)
    leaves, spec = tree_flatten(data)
    lazy_model.sync_tensors(leaves)
    directory = path + _SUFFIX
    parent = os.path.dirname(os.path.abspath(path))
    staging = tempfile.mkdtemp(prefix=os.path.basename(path) + ".", suffix=".saving", dir=parent)
    try:
        refs, out = {}, []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                ref = refs.get(id(x))
                if ref is None:
                    ref = refs[id(x)] = TensorReference(len(refs))
                    torch.save(_on_cpu(x), _tensor_file(staging, ref.tid))
                x = ref
            out.append(x)
        torch.save(tree_unflatten(out, spec), os.path.join(staging, "structure.pt"))
        # Everything is written: only now does the previous checkpoint at `path` go.
        if os.path.isdir(directory):
            shutil.rmtree(directory)
        os.replace(os.path.join(staging, "structure.pt"), path)
        os.replace(staging, directory)
    finally:
        if os.path.isdir(staging):
            shutil.rmtree(staging)


def _on_cpu(t: torch.Tensor) -> torch.Tensor:
    if lazy_model.is_lazy_tensor(t):
        return lazy_model.cpu_copy(t)
    return t


def load(path: str):
    """Return the data `save` wrote to `path`, its tensors on the CPU (torch.load, weights_only)."""
    path = os.fspath(path)
    directory = path + _SUFFIX
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory} is missing: {path} was not written by "
                                "ratex.lazy_tensor_core.utils.serialization.save (torch.load reads lazy_model.save's files)")
    with torch.serialization.safe_globals([TensorReference]):
        data = torch.load(path, weights_only=True)
    leaves, spec = tree_flatten(data)
    loaded = {}
    out = []
    for x in leaves:
        if isinstance(x, TensorReference):
            t = loaded.get(x.tid)
            if t is None:
                t = loaded[x.tid] = torch.load(_tensor_file(directory, x.tid), weights_only=True)
            x = t
        out.append(x)
    return tree_unflatten(out, spec)


__all__ = ["save", "load", "TensorReference"]
