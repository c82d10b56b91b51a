"""Recording: a functional op becomes one IR node, its outputs lazy tensors; float scalars
that change every step become graph inputs.

Output metas are inferred on meta tensors (memoized, shape.py); an op whose outputs
have no elements records nothing (they are device data at once); an op with no meta
kernel or no lowering rule goes to PyTorch's decomposition or runs eagerly.
"""
import torch

import tvm_lowering
from .. import ir, metrics, shape
from ..device import backend
from ..ir import Node, op_name
from ..tensor import LazyTensor
from . import registry
from .capture import Value, collect
from .eager import is_unlowerable, run as eager, unlowerable
from .registry import PATH, register
from .torch_decomp import decomposed_or_eager

aten = torch.ops.aten
_EMPTY = {}


@register("functional", tier=PATH)
def functional(func, args, kwargs):
    """Record a functional op; return its outputs as lazy tensors (or what a fallback returns)."""
    given = func, args  # what the fallbacks below run: the call as made, before any lifting
    if id(func) in LIFT:
        func, args = lift_scalar(func, args)
    spec, values, metas = collect(func, args, kwargs)
    try:
        out = shape.infer(func, spec, metas)
    except shape.NoMeta:
        return decomposed_or_eager(*given, kwargs, None)
    if out.empty:
        return empty_outputs(out)
    counter = lowered_counter(func)
    if counter is None:
        return decomposed_or_eager(*given, kwargs, out)
    node = new_node(func, spec, values, out, counter)
    return eager(*given, kwargs) if node is None else wrap(node, out)


def new_node(func, spec, values, out, counter):
    """Record a node of a lowered op (its counter `ratex::<op>`); None where its rule failed
    on this very node before."""
    node = Node(func, spec, tuple(values), out.metas, out.kind != "tensor", out.key)
    if unlowerable and is_unlowerable(node):
        return None
    _counts[counter] += 1
    return node


def value_op(func, *args):
    """`dispatch(func, args)` for an intermediate result that no user sees: a lowered
    single-output op comes back as its IR value (a Value) with no LazyTensor built for it;
    anything else (no meta kernel, no rule, no elements) as `dispatch` returns it.
    Decompositions and the in-place fast path chain these (a tensor costs more than a node)."""
    if id(func) in LIFT:
        func, args = lift_scalar(func, args)
    spec, values, metas = collect(func, args, _EMPTY)
    try:
        out = shape.infer(func, spec, metas)
    except shape.NoMeta:
        out = None
    counter = lowered_counter(func) if out is not None and out.kind == "tensor" and not out.empty else None
    if counter is not None:
        node = new_node(func, spec, values, out, counter)
        if node is not None:
            return Value((node, 0))
    return registry.dispatch(func, args, {})


def wrap(node, out):
    """Return the outputs of `node` as lazy tensors, in the structure `out` describes."""
    if out.kind == "tensor":
        return LazyTensor.from_value((node, 0), out.strides[0], out.offsets[0])
    outs = [
        None if m is None else LazyTensor.from_value((node, i), out.strides[i], out.offsets[i])
        for i, m in enumerate(out.metas)
    ]
    if out.kind == "tensor":
        return outs[0]
    return tuple(outs) if out.kind == "tuple" else outs


def empty_outputs(out):
    """Return outputs without elements, which have no values to compute: device data at once."""
    outs = [None if m is None else LazyTensor.from_cpu(torch.empty(m.shape, dtype=m.dtype), adopt=True)
            for m in out.metas]
    if out.kind == "tensor":
        return outs[0]
    return tuple(outs) if out.kind == "tuple" else outs


def lowered_counter(func):
    """Return the counter name `ratex::<op>` if `func` has a lowering rule, else None."""
    try:
        return _counters[id(func)]
    except KeyError:
        name = op_name(func)
        _counters[id(func)] = counter = f"ratex::{name}" if tvm_lowering.has_rule(name) else None
        _kept.append(func)  # its id stays valid
        return counter


_counters, _kept = {}, []  # id(OpOverload) -> counter name or None (by id: see registry._routes)
_counts = metrics.counts


# ---- scalar lifting ---------------------------------------------------------------------
# Float scalars that change every step (learning rates, loss scales) become graph
# inputs, so they don't bake into the program and force a recompile. By id, like _routes.
LIFT = {id(f): to for f, to in (
    (aten.add.Tensor, aten.add.Tensor),
    (aten.sub.Tensor, aten.sub.Tensor),
    (aten.mul.Tensor, aten.mul.Tensor),
    (aten.div.Tensor, aten.div.Tensor),
    (aten.add.Scalar, aten.add.Tensor),
    (aten.sub.Scalar, aten.sub.Tensor),
    (aten.mul.Scalar, aten.mul.Tensor),
    (aten.div.Scalar, aten.div.Tensor),
    # A value read into Python and compared with a tensor: a line search's `f_new > f + c1 * t * gtd`.
    *((getattr(aten, name).Scalar, getattr(aten, name).Tensor) for name in ("lt", "le", "gt", "ge", "eq", "ne")),
)}


def liftable(x) -> bool:
    """Return whether `x` is a float scalar that becomes a graph input (not 0 or ±1)."""
    return type(x) is float and x not in (0.0, 1.0, -1.0)


def float_scalar_dtype(dtype) -> torch.dtype:
    """The dtype a Python float takes next to a tensor of `dtype` under PyTorch's promotion rules."""
    return dtype if dtype.is_floating_point or dtype.is_complex else torch.get_default_dtype()


_MULS = (aten.mul.Tensor, aten.mul.Scalar)
_PRODUCTS = (*_MULS, aten.div.Tensor, aten.div.Scalar)


def lifted_dtype(func, dtype) -> torch.dtype:
    """The dtype of the 0-dim input a Python float next to a tensor of `dtype` becomes in `func`.

    PyTorch's CPU mul and div read a scalar operand of a float16/bfloat16 tensor at float32
    precision (0.01 is not 0.010009765625); add and sub round it to the tensor's dtype first."""
    if func in _PRODUCTS and dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return float_scalar_dtype(dtype)


def lift_scalar(func, args):
    """Return (func, args) with a liftable scalar second argument made a graph input."""
    if len(args) < 2:
        return func, args
    first, scalar = args[0], args[1]
    t = type(first)
    if t is LazyTensor:
        shape, dtype = first._sig[0], first._sig[2]
    elif t is Value:
        shape, dtype = first.value[0].metas[first.value[1]]
    elif isinstance(first, LazyTensor):
        shape, dtype = first.shape, first.dtype
    else:
        return func, args
    if not shape and lifted_dtype(func, dtype) != float_scalar_dtype(dtype):
        # A float32 0-dim input next to a 0-dim half tensor would promote the product to float32
        # (a Python scalar does not): the scalar stays a constant.
        return func, args
    if not liftable(scalar):
        # x * 0 as a constant is folded to 0 by TVM's simplifier, but NaN * 0 and inf * 0 are NaN.
        zero_times_float = func in _MULS and type(scalar) in (int, float) and scalar == 0 and dtype.is_floating_point
        if not zero_times_float:
            return func, args
    lifted = (first, scalar_input(scalar, lifted_dtype(func, dtype)))
    return LIFT[id(func)], (lifted + tuple(args[2:]) if len(args) > 2 else lifted)


def scalar_input(value, dtype):
    """Return a Python scalar as a 0-dim device-data input (an IR value: no LazyTensor to build).

    Each (value, dtype) is made once and shared, leaf node and all: programs never
    write into a leaf that no tensor owns, and an optimizer lifts the same few scalars
    (lr, momentum) for every parameter of every step (torch.tensor is slow to make).
    """
    be = backend()
    key = (ir.float_atom(value) if type(value) is float else value, dtype, be)  # -0.0 apart from 0.0
    leaf = _scalar_data.get(key)
    if leaf is None:
        if len(_scalar_data) >= 1024:  # a schedule that sweeps the lr: keep the dict small
            _scalar_data.clear()
        metrics.counter_inc("DeviceDataTransfer")
        data = be.adopt(torch.tensor(value, dtype=dtype))
        leaf = _scalar_data[key] = Value((Node.leaf(data, ir.Meta((), dtype)), 0))
    return leaf


_scalar_data = {}  # (value, dtype, backend) -> Value of a leaf holding the 0-dim tensor
