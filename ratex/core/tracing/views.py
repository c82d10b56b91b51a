"""Views: a view op's result shares its base's Storage and extends the view chain.

Nothing is computed for a view until it is read (ratex/core/chain.py replays the
chain); multi-output views (split, unbind) are expressed as slices and selects,
so that writes through them scatter back.
"""
import functools

import torch

from .. import metrics, shape
from ..chain import IDENTITY_VIEWS
from ..ir import Meta, Node, op_name
from ..tensor import LazyTensor
from .capture import collect
from .eager import run as eager
from .record import lowered_counter
from .registry import HANDLER, PATH, register
from .schema import is_composite
from .torch_decomp import decomposed

aten = torch.ops.aten


@register("view", tier=PATH)
def view(func, args, kwargs):
    """Return the view `func` makes of a lazy tensor, on its base's storage."""
    base = args[0]
    if not isinstance(base, LazyTensor):
        return eager(func, args, kwargs)
    spec, values, metas = collect(func, args, kwargs)
    try:
        out = shape.infer(func, spec, metas)
    except shape.NoMeta:
        return eager(func, args, kwargs)
    if out.kind != "tensor":
        return eager(func, args, kwargs)
    # Composite views (reshape, to, movedim, ...) reach here from inside decompositions: their
    # own decomposition yields primitive views, which in-place writes can be scattered back through.
    if lowered_counter(func) is None or is_composite(func):
        result = decomposed(func, args, kwargs, out)
        if result is not NotImplemented:
            return result
    metrics.counter_inc(_view_counter(func))
    value = (Node(func, spec, tuple(values), out.metas, key=out.key), 0)
    return LazyTensor(base._st, base._chain + ((func, spec),), out.metas[0], out.strides[0], out.offsets[0], value)


@register(*IDENTITY_VIEWS, tier=HANDLER)
def _identity_view(func, args, kwargs):
    """detach/alias (autograd detaches every new gradient): a new tensor on the same storage
    and view chain, so the same value; nothing to infer or record."""
    base = args[0]
    if not isinstance(base, LazyTensor):
        return eager(func, args, kwargs)
    shape_, stride, dtype = base._sig
    metrics.counts[_view_counter(func)] += 1
    return LazyTensor(base._st, base._chain, Meta(shape_, dtype), stride, base.storage_offset(),
                      base._value() if base._chain else None)


@functools.lru_cache(maxsize=None)
def _view_counter(func):
    return f"ratex::{op_name(func)}"


@register(aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.unsafe_split.Tensor,
          aten.tensor_split.sections, aten.unsafe_split_with_sizes.default, tier=HANDLER)
def _split_views(func, args, kwargs):
    """split/split_with_sizes/tensor_split/unbind return views; express each as slice/select so writes work."""
    self = args[0]
    name = op_name(func)
    if name == "unbind.int":
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        return tuple(aten.select.int(self, dim, i) for i in range(self.shape[dim]))
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    size = self.shape[dim]
    if name in ("split.Tensor", "unsafe_split.Tensor"):
        step = args[1]
        sizes = [min(step, size - s) for s in range(0, size, step)] if size else [0]
    elif name == "tensor_split.sections":  # the first size % n parts get one element more
        n = args[1]
        if n <= 0:
            raise RuntimeError(f"number of sections must be larger than 0, got {n}")
        sizes = [size // n + (i < size % n) for i in range(n)]
    else:
        sizes = list(args[1])
        if sum(sizes) != size:
            raise RuntimeError(f"split_with_sizes expects split_sizes to sum exactly to {size}, but got {sizes}")
    outs, start = [], 0
    for s in sizes:
        outs.append(aten.slice.Tensor(self, dim, start, start + s))
        start += s
    return outs
