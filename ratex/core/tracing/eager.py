"""The eager fallback: an ATen op run on CPU PyTorch, its outputs back as device data.

Two callers, one way to do it: the tracer runs a call whose arguments are lazy
tensors (`run`: an op with no meta kernel, no lowering rule or decomposition, or
arguments a handler can't trace); the sync layer runs one recorded node from its
computed inputs (`run_node`: an op whose rule failed to lower or compile, listed in
`unlowerable` so that later calls like it run eagerly from the start). Either way the
counter `aten::<op>` goes up and the results are copies the device owns.
"""
import torch

from .. import metrics
from ..device import backend
from ..ir import fill, op_name
from ..launch import resolve
from ..tensor import LazyTensor
from .capture import Value
from .schema import written

# Ops whose rule failed to lower or compile on some node, by what that failure can depend on
# other than shapes: op -> {(non-tensor arguments, input dtypes, output dtypes)}. A node that
# matches runs eagerly from the start, at every shape, so a new input shape does not search for
# it again (sync.py). The sync layer adds to it (`mark_unlowerable`); the tracer asks per node
# (`is_unlowerable`) once it is not empty. Never rebound (modules hold the dict itself).
unlowerable = {}


def _signature(node) -> tuple:
    return (node.spec, tuple([n.metas[i].dtype for n, i in node.inputs]),
            tuple([m.dtype if m is not None else None for m in node.metas]))


def is_unlowerable(node) -> bool:
    """Return whether a node like `node` (same op, non-tensor arguments and dtypes) failed before."""
    known = unlowerable.get(node.key[0])
    return known is not None and _signature(node) in known


def mark_unlowerable(node):
    """Remember that `node`'s rule fails, so that nodes like it run eagerly; return None."""
    unlowerable.setdefault(node.key[0], set()).add(_signature(node))


def _call(func, args, kwargs):
    """Run `func` on CPU arguments, counted as a fallback (`aten::<op>`); return its outputs."""
    metrics.counter_inc(f"aten::{op_name(func)}")
    return func(*args, **kwargs)


def run(func, args, kwargs):
    """Run `func` on CPU PyTorch with materialized inputs; return its results as lazy tensors.

    Arguments the op writes (its schema says which) get the new values written back.
    """
    copies = {}

    def to_cpu(x):
        if type(x) is Value:  # an intermediate value of a decomposition
            x = LazyTensor.from_value(x.value)
        if isinstance(x, LazyTensor):
            c = x._to_cpu()
            copies[id(c)] = x
            return c
        if isinstance(x, torch.device) and x.type == "lazy":
            return torch.device("cpu")
        return x

    cpu_args = [_map(to_cpu, a) for a in args]
    cpu_kwargs = {k: _map(to_cpu, v) for k, v in kwargs.items()}
    out = _call(func, cpu_args, cpu_kwargs)
    for kind, key in written(func):
        cpu = cpu_args[key] if kind == "pos" else cpu_kwargs.get(key)
        for c in cpu if isinstance(cpu, (list, tuple)) else [cpu]:
            if isinstance(c, torch.Tensor) and id(c) in copies:
                lazy, new = copies[id(c)], LazyTensor.from_cpu(c)
                if tuple(new.shape) == tuple(lazy.shape) and new.dtype == lazy.dtype:
                    lazy._write(new._value())
                else:  # the op changed the tensor's metadata (resize_, set_, ...)
                    lazy._assume(new)

    def back(o):
        if isinstance(o, torch.Tensor):
            orig = copies.get(id(o))
            return orig if orig is not None else LazyTensor.from_cpu(o)
        return o

    return _map(back, out)


def run_node(node):
    """Compute the op node `node` on CPU PyTorch from its computed inputs; keep the results on it."""
    be = backend()
    cpu_inputs = [be.view_cpu(resolve(n.results[i]), n.metas[i].dtype) for n, i in node.inputs]
    args, kwargs = fill(node.spec, cpu_inputs)
    out = _call(node.op, args, kwargs)
    outs = list(out) if node.multi else [out]
    for i, o in enumerate(outs):
        if o is not None:
            node.set_result(i, be.upload(o))  # a copy: eager outputs may alias inputs


def _map(fn, x):
    if isinstance(x, (list, tuple)):
        return type(x)(_map(fn, y) for y in x)
    return fn(x)
