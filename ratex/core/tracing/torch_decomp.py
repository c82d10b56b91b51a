"""PyTorch's own decompositions: the tier between a lowering rule and the CPU.

An op with no meta kernel or no lowering rule is traced through torch._decomp's
decomposition, or its CompositeImplicitAutograd kernel, when it has one whose
outputs match the op's; otherwise it runs eagerly.
"""
import functools

import torch
import torch._decomp

from ..tensor import LazyTensor
from . import eager
from .schema import is_composite

_decomposing = set()  # ops whose decomposition is running (one that re-emits its own op runs it eagerly)


# Ops whose torch._decomp decomposition computes something else than the ATen op: they run
# eagerly. multilabel_margin_loss_forward reads a 1-d input's elements as the batch and its
# sums differ from ATen's for batches too.
_WRONG = frozenset((torch.ops.aten.multilabel_margin_loss_forward.default,))


@functools.lru_cache(maxsize=None)
def _torch_decomp(func):
    """PyTorch's decomposition of `func`, or None (random ops keep their own seeded path;
    decompositions known to be wrong are not used).

    torch._decomp's table first; else the op's CompositeImplicitAutograd kernel,
    for composite ops that reach the lazy device from inside another decomposition.
    """
    if torch.Tag.nondeterministic_seeded in func.tags or func in _WRONG:
        return None
    found = torch._decomp.decomposition_table.get(func)
    if found is None and is_composite(func):
        found = func.decompose
    return found


def decomposed_or_eager(func, args, kwargs, out):
    """Return `func` traced through PyTorch's decomposition into simpler ops, else run eagerly."""
    result = decomposed(func, args, kwargs, out)
    return eager.run(func, args, kwargs) if result is NotImplemented else result


def decomposed(func, args, kwargs, out):
    """Return `func` traced through its decomposition, or NotImplemented where it has none that works.

    `out` (the inferred outputs, None where there is no meta kernel) must match
    what the decomposition produced: one whose shapes or dtypes differ is not used.
    """
    decomp = _torch_decomp(func)
    if decomp is None or func in _decomposing:
        return NotImplemented
    _decomposing.add(func)
    try:
        result = decomp(*args, **kwargs)
    except Exception:  # noqa: BLE001 - e.g. a decomposition written for other tensor types: CPU is right
        result = NotImplemented
    finally:
        _decomposing.discard(func)
    if result is NotImplemented or (out is not None and not _matches(result, out)):
        return NotImplemented
    return result


def _matches(result, out) -> bool:
    results = [result] if out.kind == "tensor" else list(result) if isinstance(result, (tuple, list)) else None
    if results is None or len(results) != len(out.metas):
        return False
    for r, m in zip(results, out.metas):
        if m is None:
            continue
        if not isinstance(r, LazyTensor) or tuple(r.shape) != m.shape or r.dtype != m.dtype:
            return False
    return True
