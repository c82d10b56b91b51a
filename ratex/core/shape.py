"""Shape inference: run the op on meta tensors, memoized on (op, args, input metas).

Errors PyTorch raises for bad shapes come out here, at the op that caused
them, not at mark_step.
"""
import copy
import functools

import torch

from .ir import Meta, fill, op_key

_memo = {}


class NoMeta(Exception):
    """The op has no meta kernel or a data-dependent output shape; run it eagerly instead."""


class Out:
    """The inferred outputs of one op: a flat list of (meta, stride, offset) and the structure.
    `empty`: no output has an element (a None output counts as empty). `key`: the node key
    (ir.Node.key) of every node recorded from this result, one object for all of them."""

    __slots__ = ("metas", "strides", "offsets", "kind", "empty", "key")

    def __init__(self, metas, strides, offsets, kind):
        self.metas, self.strides, self.offsets, self.kind = metas, strides, offsets, kind
        self.empty = all(m is None or 0 in m.shape for m in metas)
        self.key = None


def infer(op, spec, in_metas: tuple) -> Out:
    """Return the outputs of `op` applied to inputs with `in_metas` (shape, stride, dtype)."""
    key = (id(op), spec, in_metas)  # by id: OpOverload.__hash__ is Python code; ATen ops live forever
    hit = _memo.get(key)
    if hit is None:
        hit = _run(op, spec, in_metas)
        if type(hit) is Out:
            # One key object for every node of this op, arguments and input metas, step after
            # step: graph keys made of them compare by identity (graph.replay, the compile cache).
            hit.key = (op_key(op), spec, hit.metas)
        _memo[key] = hit
    if type(hit) is not Out:
        # A copy: raising the memoized exception itself would leave on it the traceback of the
        # latest raise, whose frames hold that call's lazy tensors alive (and pending) for good.
        raise copy.copy(hit)
    return hit


def _run(op, spec, in_metas):
    fakes = [torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in in_metas]
    args, kwargs = fill(spec, fakes)
    if _takes_device(op):
        kwargs["device"] = "meta"
    try:
        out = op(*args, **kwargs)
    except (NotImplementedError, torch._subclasses.fake_tensor.DynamicOutputShapeException) as exc:
        return NoMeta(str(exc))
    except RuntimeError as exc:
        msg = str(exc)
        low = msg.lower()
        if "meta" in low and ("not implemented" in low or "backend" in low or "cannot be called on meta" in low
                              or "a meta tensor" in low):  # repeat_interleave: its size depends on values
            return NoMeta(msg)
        return exc
    if isinstance(out, torch.Tensor):
        return _pack([out], "tensor")
    if isinstance(out, (tuple, list)) and out and all(o is None or isinstance(o, torch.Tensor) for o in out):
        if id(op) in _BATCH_NORMS:
            out = _batch_norm_stats_dtype(out, args)
        return _pack(list(out), "tuple" if isinstance(out, tuple) else "list")
    return NoMeta(f"{op} returns {type(out).__name__}, not tensors")


_aten = torch.ops.aten
_BATCH_NORMS = {id(op) for op in (
    _aten.native_batch_norm.default, _aten._native_batch_norm_legit.default, _aten._native_batch_norm_legit.no_stats,
    _aten._native_batch_norm_legit_no_training.default, _aten._native_batch_norm_legit_functional.default,
    _aten._batch_norm_with_update.default, _aten._batch_norm_no_update.default)}


def _batch_norm_stats_dtype(out, args):
    """The saved mean and inverse std of a float16/bfloat16 batch norm in the dtype CPU PyTorch
    returns them in: float32 where a weight, bias or running statistic is float32, else the
    input's dtype. The meta kernels say float32 either way."""
    x = args[0]
    if x.dtype not in (torch.float16, torch.bfloat16):
        return out
    params = [a for a in args[1:5] if isinstance(a, torch.Tensor)]
    dt = torch.float32 if any(p.dtype == torch.float32 for p in params) else x.dtype
    return type(out)(o.to(dt) if i in (1, 2) and o is not None and o.dtype == torch.float32 else o
                     for i, o in enumerate(out))


def _pack(outs, kind):
    """None outputs (e.g. masked-off gradients of convolution_backward) keep a None meta."""
    return Out(
        tuple(None if o is None else Meta(tuple(o.shape), o.dtype) for o in outs),
        tuple(None if o is None else tuple(o.stride()) for o in outs),
        tuple(None if o is None else o.storage_offset() for o in outs),
        kind,
    )


def _takes_device(op) -> bool:
    return any(a.name == "device" for a in op._schema.arguments)


@functools.lru_cache(maxsize=4096)
def contiguous_strides(shape: tuple) -> tuple:
    """Return the strides of a contiguous tensor of `shape`."""
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))
