"""Tracing: how one ATen call on lazy tensors becomes IR, a view, a write, or an eager run.

`dispatch` is the whole policy, in order:
  1. handlers for ops that need care (sync points, copies, fills, multi-output views,
     detach, and in-place arithmetic on same-shape operands, recorded without result tensors),
  2. Python decompositions (foreach ops, alpha/value scalars) into simpler ATen ops,
  3. view ops: share the base's Storage, extend the view chain,
  4. in-place and out= ops: compute functionally, then write through the view chain,
  5. functional ops: infer output metas (memoized) and record one node
     (none at all when every output is empty: those are device data at once);
an op without a meta kernel or a lowering rule is traced through PyTorch's own
decomposition (torch._decomp, or its CompositeImplicitAutograd kernel) when it
has one whose outputs match, and otherwise runs eagerly on CPU (counter
`aten::<op>`), its outputs becoming device data.
"""
import functools

import torch
import torch._decomp

import tvm_lowering
from .. import config
from . import metrics, shape, sync, tensor
from . import ir
from .ir import Node, fill, op_name, template

aten = torch.ops.aten
_DEVICE_KWARGS = ("device", "pin_memory")
HANDLERS = {}


def handles(*funcs):
    """Register a handler fn(func, args, kwargs) for the given OpOverloads."""

    def register(fn):
        for f in funcs:
            HANDLERS[f] = fn
        return fn

    return register


def dispatch(func, args, kwargs):
    """Trace (or run) one ATen call whose arguments include lazy tensors."""
    route = _routes.get(id(func))
    if route is None:
        route = _routes[id(func)] = _route(func)
        _routed.append(func)
    return route(func, args, kwargs)


# By id: OpOverload.__hash__ is Python code (~0.3 us a call). _routed keeps the ops alive.
_routes, _routed = {}, []


def _route(func):
    """Choose, once per OpOverload, which path of the policy above handles it."""
    handler = HANDLERS.get(func)
    if handler is not None:
        return handler
    if func.__name__.startswith("_foreach_"):
        return _foreach
    decomp = DECOMPS.get(func)
    fallthrough = _view if func.is_view else _mutating if func._schema.is_mutable else _functional
    if decomp is None:
        return fallthrough

    def decomposed(func, args, kwargs):
        out = decomp(*args, **kwargs)
        return fallthrough(func, args, kwargs) if out is NotImplemented else out

    return decomposed


# ---- inputs ----------------------------------------------------------------
class _V:
    """An IR value passed where a tensor argument goes, for ops emitted internally."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


_ARG_TENSOR_TYPES = (torch.Tensor, _V)


def _is_arg_tensor(x):
    return isinstance(x, _ARG_TENSOR_TYPES)


_NO_KWARGS = ("__dict__", ())
# As on CUDA, indexing ops take CPU index tensors (they are moved to the device).
_CPU_INDICES_OK = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_ATOMS = ir.ATOMS


def _tmpl(x, found):
    """`ir.template` for one argument, specialised for the hot path."""
    t = type(x)
    if t is float:
        return ir.float_atom(x)
    if t in _ATOMS:
        return x
    if t is list or t is tuple:
        items = tuple([_tmpl(i, found) for i in x])
        return items if t is tuple else ("__list__", items)
    if isinstance(x, _ARG_TENSOR_TYPES):
        found.append(x)
        return ir.slot(len(found) - 1)
    return template(x, found, _is_arg_tensor)


def _collect(func, args, kwargs):
    """Return (spec, input values, input metas) for a call, checking devices."""
    if not kwargs and len(args) == 2 and _is_value_arg(args[0]) and _is_value_arg(args[1]):  # x + y
        return _BINARY_SPEC, [_arg_value(args[0]), _arg_value(args[1])], (_arg_sig(args[0]), _arg_sig(args[1]))
    if not kwargs and len(args) == 3 and _is_value_arg(args[0]) and _is_value_arg(args[1]) \
            and _is_value_arg(args[2]):  # addcmul(p, buf, lr)
        return _TERNARY_SPEC, [_arg_value(a) for a in args], tuple([_arg_sig(a) for a in args])
    if any(k in kwargs for k in _DEVICE_KWARGS):
        kwargs = {k: v for k, v in kwargs.items() if k not in _DEVICE_KWARGS}
    found = []
    spec = (
        tuple([_tmpl(a, found) for a in args]),
        ("__dict__", tuple([(k, _tmpl(v, found)) for k, v in kwargs.items()])) if kwargs else _NO_KWARGS,
    )
    values, metas = [], []
    for t in found:
        if isinstance(t, _V):
            values.append(t.value)
            metas.append(_arg_sig(t))
            continue
        if not isinstance(t, tensor.LazyTensor):
            if t.device.type == "cpu" and (t.dim() == 0 or func in _CPU_INDICES_OK):
                t = tensor.LazyTensor.from_cpu(t)  # like CUDA: 0-dim CPU tensors are scalars
            else:
                raise RuntimeError(
                    f"Expected all tensors to be on the same device, but found at least two devices, "
                    f"lazy:0 and {t.device}! (when checking arguments for {func}; move the {t.device} "
                    f"tensor of shape {tuple(t.shape)} to the lazy device with .to('lazy'))"
                )
        values.append(t._value())
        metas.append(t._sig)
    return spec, values, tuple(metas)


def _wrap(node, out):
    outs = [
        None if m is None else tensor.LazyTensor.from_value((node, i), out.strides[i], out.offsets[i])
        for i, m in enumerate(out.metas)
    ]
    if out.kind == "tensor":
        return outs[0]
    return tuple(outs) if out.kind == "tuple" else outs


# ---- functional ops ----------------------------------------------------------
def _functional(func, args, kwargs):
    given = func, args  # what the fallbacks below run: the call as made, before any lifting
    if id(func) in _LIFT:
        func, args = _lift_scalar(func, args)
    spec, values, metas = _collect(func, args, kwargs)
    try:
        out = shape.infer(func, spec, metas)
    except shape.NoMeta:
        return _decomposed_or_eager(*given, kwargs, None)
    if out.empty:
        return _empty_outputs(out)
    counter = _lowered_counter(func)
    if counter is None:
        return _decomposed_or_eager(*given, kwargs, out)
    node = _new_node(func, spec, values, out, counter)
    return eager(*given, kwargs) if node is None else _wrap(node, out)


def _new_node(func, spec, values, out, counter):
    """Record a node of a lowered op (its counter `ratex::<op>`); None where its rule failed
    on this very node before."""
    node = Node(func, spec, tuple(values), out.metas, multi=out.kind != "tensor")
    if sync.unlowerable and node.key in sync.unlowerable:
        return None
    metrics.counts[counter] += 1
    return node


def _value_op(func, *args):
    """`dispatch(func, args)` for an intermediate result that no user sees: a lowered
    single-output op comes back as its IR value (a _V) with no LazyTensor built for it;
    anything else (no meta kernel, no rule, no elements) as `dispatch` returns it.
    Decompositions and the in-place fast path chain these (a tensor costs ~4 us)."""
    if id(func) in _LIFT:
        func, args = _lift_scalar(func, args)
    spec, values, metas = _collect(func, args, _EMPTY)
    try:
        out = shape.infer(func, spec, metas)
    except shape.NoMeta:
        out = None
    counter = _lowered_counter(func) if out is not None and out.kind == "tensor" and not out.empty else None
    if counter is not None:
        node = _new_node(func, spec, values, out, counter)
        if node is not None:
            return _V((node, 0))
    return dispatch(func, args, {})


_EMPTY = {}
_BINARY_SPEC = ((ir.slot(0), ir.slot(1)), _NO_KWARGS)  # what _collect makes of f(tensor, tensor)
_TERNARY_SPEC = ((ir.slot(0), ir.slot(1), ir.slot(2)), _NO_KWARGS)


def _is_value_arg(x) -> bool:
    t = type(x)
    return t is _V or t is tensor.LazyTensor


def _arg_value(x):
    return x.value if type(x) is _V else x._value()


def _arg_sig(x):
    """(shape, strides, dtype) of a lazy tensor or an IR value, as `_collect` gives it."""
    if type(x) is not _V:
        return x._sig
    meta = x.value[0].metas[x.value[1]]
    return meta.shape, tensor._contiguous_strides(meta.shape), meta.dtype


def _empty_outputs(out):
    """Outputs without elements have no values to compute: they are device data at once."""
    outs = [None if m is None else tensor.LazyTensor.from_cpu(torch.empty(m.shape, dtype=m.dtype), adopt=True)
            for m in out.metas]
    if out.kind == "tensor":
        return outs[0]
    return tuple(outs) if out.kind == "tuple" else outs


def _lowered_counter(func):
    """The counter name `ratex::<op>` if `func` has a lowering rule, else None."""
    try:
        return _counters[id(func)]
    except KeyError:
        name = op_name(func)
        _counters[id(func)] = counter = f"ratex::{name}" if tvm_lowering.has_rule(name) else None
        _routed.append(func)  # its id stays valid
        return counter


_counters = {}  # id(OpOverload) -> counter name or None (by id: see _routes)


def emit(func, *args, **kwargs):
    """Record `func` on IR values (wrapped in _V) and return its single output value."""
    spec, values, metas = _collect(func, args, kwargs)
    out = shape.infer(func, spec, metas)
    return (Node(func, spec, tuple(values), out.metas), 0)


def record_value(func, spec, value):
    """Record a single-input op given by (func, spec) on `value`; return the output value."""
    if func in _IDENTITY_VIEWS:
        return value
    meta = value[0].metas[value[1]]
    out = shape.infer(func, spec, ((meta.shape, tensor._contiguous_strides(meta.shape), meta.dtype),))
    return (Node(func, spec, (value,), out.metas), 0)


# Views whose value is their input's: no node, so a detached parameter stays device data.
_IDENTITY_VIEWS = {aten.detach.default, aten.alias.default}


# Float scalars that change every step (learning rates, loss scales) become graph
# inputs, so they don't bake into the program and force a recompile. By id, like _routes.
_LIFT = {id(f): to for f, to in (
    (aten.add.Tensor, aten.add.Tensor),
    (aten.sub.Tensor, aten.sub.Tensor),
    (aten.mul.Tensor, aten.mul.Tensor),
    (aten.div.Tensor, aten.div.Tensor),
    (aten.add.Scalar, aten.add.Tensor),
    (aten.sub.Scalar, aten.sub.Tensor),
    (aten.mul.Scalar, aten.mul.Tensor),
    (aten.div.Scalar, aten.div.Tensor),
)}


def _liftable(x) -> bool:
    return type(x) is float and x not in (0.0, 1.0, -1.0)


def _float_scalar_dtype(dtype) -> torch.dtype:
    """The dtype a Python float takes next to a tensor of `dtype` under PyTorch's promotion rules."""
    return dtype if dtype.is_floating_point or dtype.is_complex else torch.get_default_dtype()


_MULS = (aten.mul.Tensor, aten.mul.Scalar)
_PRODUCTS = (*_MULS, aten.div.Tensor, aten.div.Scalar)


def _lifted_dtype(func, dtype) -> torch.dtype:
    """The dtype of the 0-dim input a Python float next to a tensor of `dtype` becomes in `func`.

    PyTorch's CPU mul and div read a scalar operand of a float16/bfloat16 tensor at float32
    precision (0.01 is not 0.010009765625); add and sub round it to the tensor's dtype first."""
    if func in _PRODUCTS and dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return _float_scalar_dtype(dtype)


def _lift_scalar(func, args):
    if len(args) < 2:
        return func, args
    first, scalar = args[0], args[1]
    t = type(first)
    if t is tensor.LazyTensor:
        dtype = first._sig[2]
    elif t is _V:
        dtype = first.value[0].metas[first.value[1]].dtype
    elif isinstance(first, tensor.LazyTensor):
        dtype = first.dtype
    else:
        return func, args
    if not _liftable(scalar):
        # x * 0 as a constant is folded to 0 by TVM's simplifier, but NaN * 0 and inf * 0 are NaN.
        zero_times_float = func in _MULS and type(scalar) in (int, float) and scalar == 0 and dtype.is_floating_point
        if not zero_times_float:
            return func, args
    lifted = (first, _scalar_input(scalar, _lifted_dtype(func, dtype)))
    return _LIFT[id(func)], (lifted + tuple(args[2:]) if len(args) > 2 else lifted)


def _scalar_input(value, dtype):
    """A Python scalar as a 0-dim device-data input (an IR value: no LazyTensor to build).

    Each (value, dtype) is made once and shared, leaf node and all: programs never
    write into a leaf that no tensor owns, and an optimizer lifts the same few scalars
    (lr, momentum) for every parameter of every step (torch.tensor costs ~7 us).
    """
    be = tensor.backend()
    key = (ir.float_atom(value) if type(value) is float else value, dtype, be)  # -0.0 apart from 0.0
    leaf = _scalar_data.get(key)
    if leaf is None:
        if len(_scalar_data) >= 1024:  # a schedule that sweeps the lr: keep the dict small
            _scalar_data.clear()
        metrics.counter_inc("DeviceDataTransfer")
        data = be.adopt(torch.tensor(value, dtype=dtype))
        leaf = _scalar_data[key] = _V((Node.leaf(data, ir.Meta((), dtype)), 0))
    return leaf


_scalar_data = {}  # (value, dtype, backend) -> _V of a leaf holding the 0-dim tensor


# ---- decompositions -----------------------------------------------------------
# These run inside __torch_dispatch__, below autograd: their ops go to `dispatch` directly
# rather than through torch's dispatcher again (a round trip of about 8 us per op).
def _call(op, *args, **kwargs):
    return dispatch(op, args, kwargs)


# Each takes `last`, which records the final op: `_call` for a decomposition (a tensor the user
# gets), `_value_op` for the in-place fast path below (a value written straight into the target).
def _add_alpha(func):
    def decomp(a, b, *, alpha=1, last=_call):
        if alpha == 1 or not _is_arg_tensor(b):
            return NotImplemented
        if _liftable(alpha) and _is_value_arg(a) and _is_value_arg(b):
            # One node, a + b * alpha (addcmul's rule), as PyTorch computes it: in the result's dtype
            # (float32 for float16/bfloat16), alpha rounded to it, b not first multiplied in its own
            # dtype (Muon adds a bfloat16 update to a float32 parameter with alpha = -lr).
            dtype = torch.promote_types(_arg_sig(a)[2], _arg_sig(b)[2])
            if dtype.is_floating_point:
                sign = -1 if func is aten.sub.Tensor else 1
                value = _value_op(aten.addcmul.default, a, b, _scalar_input(sign * alpha, dtype))
                if type(value) is _V and last is _call:
                    return tensor.LazyTensor.from_value(value.value)
                return value
        return last(func, a, _value_op(aten.mul.Tensor, b, alpha))

    return decomp


def _addcmul(self, t1, t2, *, value=1, last=_call):
    return last(aten.add.Tensor, self, _value_op(aten.mul.Tensor, _value_op(aten.mul.Tensor, t1, value), t2))


def _addcdiv(self, t1, t2, *, value=1, last=_call):
    return last(aten.add.Tensor, self, _value_op(aten.mul.Tensor, _value_op(aten.div.Tensor, t1, t2), value))


def _lerp_scalar(self, end, weight, *, last=_call):
    return last(aten.add.Tensor, self, _value_op(aten.mul.Tensor, _value_op(aten.sub.Tensor, end, self), weight))


def _rsub_scalar(self, other, alpha=1):
    scaled = self if alpha == 1 else aten.mul.Tensor(self, alpha)
    if not _liftable(other):
        return NotImplemented
    dtype = _float_scalar_dtype(self.dtype)
    lhs = tensor.LazyTensor.from_cpu(torch.tensor(other, dtype=dtype), adopt=True)
    return aten.sub.Tensor(lhs, scaled)


def _where_scalars(cond, a, b):
    """where with Python scalars: the scalars become 0-dim tensors of the promoted dtype."""
    dtype = torch.result_type(a, b)
    a, b = (x if isinstance(x, torch.Tensor) else _functional(aten.full.default, ([], x), {"dtype": dtype})
            for x in (a, b))
    return aten.where.self(cond, aten._to_copy.default(a, dtype=dtype), aten._to_copy.default(b, dtype=dtype))


def _index_put_mask(self, indices, values, accumulate=False):
    """x[mask] = v with one boolean mask and a single value is a `where` (no data-dependent shape)."""
    if len(indices) != 1 or indices[0] is None or indices[0].dtype not in (torch.bool, torch.uint8):
        return NotImplemented
    mask = indices[0]
    if values.numel() != 1 or tuple(mask.shape) != tuple(self.shape[:mask.dim()]):
        return NotImplemented
    mask = aten.view.default(mask.to(self.device).bool(), list(mask.shape) + [1] * (self.dim() - mask.dim()))
    value = aten._to_copy.default(aten.view.default(values, []), dtype=self.dtype)
    if accumulate:
        value = aten.add.Tensor(self, value)
    return aten.where.self(mask, value, self)


def _equal(a, b):
    """torch.equal as a reduction on the device: one boolean comes back, not both tensors."""
    if not isinstance(b, torch.Tensor) or a.dtype != b.dtype:
        return NotImplemented
    if tuple(a.shape) != tuple(b.shape):
        return False
    return bool(aten.all.default(aten.eq.Tensor(a, b)).item())


DECOMPS = {
    aten.equal.default: _equal,
    aten.index_put.default: _index_put_mask,
    aten.where.ScalarSelf: _where_scalars,
    aten.where.ScalarOther: _where_scalars,
    aten.where.Scalar: _where_scalars,
    aten.add.Tensor: _add_alpha(aten.add.Tensor),
    aten.sub.Tensor: _add_alpha(aten.sub.Tensor),
    aten.addcmul.default: _addcmul,
    aten.addcdiv.default: _addcdiv,
    aten.lerp.Scalar: _lerp_scalar,
    aten.rsub.Scalar: _rsub_scalar,
}


def _foreach(func, args, kwargs):
    """`_foreach_op(lists...)` is `op` applied per element."""
    name = func._schema.name.split("::")[1][len("_foreach_"):]
    per_op = getattr(aten, name)
    n = len(args[0])
    call = (args, kwargs)
    # A foreach op may take positionally what the per-tensor op takes only by keyword
    # (_foreach_addcmul_(self, t1, t2, value) vs addcmul_(self, t1, t2, *, value)).
    schema = getattr(per_op, per_op.overloads()[0])._schema
    positional = sum(not a.kwarg_only for a in schema.arguments)
    keyword = [a.name for a in schema.arguments if a.kwarg_only]
    kwargs = dict(kwargs, **dict(zip(keyword, args[positional:])))
    args = args[:positional]
    scalars = kwargs.get("value")
    if isinstance(scalars, torch.Tensor):  # the .Tensor overloads: one scalar per element
        if isinstance(scalars, tensor.LazyTensor):
            return eager(func, *call)  # per-element Python scalars would need a sync
        kwargs = {**kwargs, "value": scalars.tolist()}

    def pick(a, i):
        return a[i] if isinstance(a, (list, tuple)) and len(a) == n else a

    # The overload torch would pick per element, where it is known: calling ratex's own route
    # for it skips torch's dispatcher (~8 us an element into a Python subclass). The elements
    # are all lazy tensors, so the call would have come straight back here anyway.
    element = _FOREACH_ELEMENT.get(name, {}).get(func._overloadname)
    if element is not None and all(type(t) is tensor.LazyTensor for t in call[0][0]):
        op = getattr(per_op, element)
        run = lambda a, k: dispatch(op, a, k)  # noqa: E731
    else:
        run = lambda a, k: per_op(*a, **k)  # noqa: E731
    results = [run([pick(a, i) for a in args], {k: pick(v, i) for k, v in kwargs.items()}) for i in range(n)]
    return None if name.endswith("_") else results


# The per-element overload torch resolves for a foreach op's overload, with a lazy tensor
# first (t.add_(t2) and t.add_(0.5) both reach add_.Tensor); the ops optimizers use.
_ARITH = {"List": "Tensor", "Scalar": "Tensor", "ScalarList": "Tensor"}
_EACH = {"Scalar": "default", "ScalarList": "default"}
_UNARY = {"default": "default"}
_FOREACH_ELEMENT = {
    **{op + tail: _ARITH for op in ("add", "sub", "mul", "div") for tail in ("", "_")},
    "addcmul_": _EACH, "addcdiv_": _EACH, "addcmul": _EACH, "addcdiv": _EACH,
    "lerp_": {"Scalar": "Scalar", "List": "Tensor"},
    **{op: _UNARY for op in ("sqrt", "sqrt_", "neg", "neg_", "reciprocal", "reciprocal_", "zero_")},
}


# ---- views -------------------------------------------------------------------
def _view(func, args, kwargs):
    base = args[0]
    if not isinstance(base, tensor.LazyTensor):
        return eager(func, args, kwargs)
    spec, values, metas = _collect(func, args, kwargs)
    try:
        out = shape.infer(func, spec, metas)
    except shape.NoMeta:
        return eager(func, args, kwargs)
    if out.kind != "tensor":
        return eager(func, args, kwargs)
    # Composite views (reshape, to, movedim, ...) reach here from inside decompositions: their
    # own decomposition yields primitive views, which in-place writes can be scattered back through.
    if _lowered_counter(func) is None or _composite(func):
        result = _decomposed(func, args, kwargs, out)
        if result is not NotImplemented:
            return result
    metrics.counter_inc(_view_counter(func))
    value = (Node(func, spec, tuple(values), out.metas), 0)
    return tensor.LazyTensor(
        base._st, base._chain + ((func, spec),), out.metas[0], out.strides[0], out.offsets[0], value
    )


@handles(*_IDENTITY_VIEWS)
def _identity_view(func, args, kwargs):
    """detach/alias (autograd detaches every new gradient): a new tensor on the same storage
    and view chain, so the same value; nothing to infer or record."""
    base = args[0]
    if type(base) is not tensor.LazyTensor:
        return eager(func, args, kwargs)
    shape_, stride, dtype = base._sig
    metrics.counts[_view_counter(func)] += 1
    return tensor.LazyTensor(base._st, base._chain, ir.Meta(shape_, dtype), stride, base.storage_offset(),
                             base._value() if base._chain else None)


@functools.lru_cache(maxsize=None)
def _view_counter(func):
    return f"ratex::{op_name(func)}"


_RESHAPES = {
    "view.default", "_unsafe_view.default", "_reshape_alias.default", "unsqueeze.default",
    "squeeze.default", "squeeze.dim", "squeeze.dims", "alias.default", "detach.default",
}


def scatter_back(func, spec, base, new):
    """Return the new value of a view's base after the view (func, spec) became `new`."""
    name = op_name(func)
    (_, *rest), kwargs = fill(spec, [None])
    base_meta = base[0].metas[base[1]]
    new_meta = new[0].metas[new[1]]
    if name in _RESHAPES:
        return new if base_meta.shape == new_meta.shape else emit(aten.view.default, _V(new), list(base_meta.shape))
    if name in ("t.default", "transpose.int"):
        return emit(func, _V(new), *rest)
    if name == "permute.default":
        dims = [d % len(base_meta.shape) for d in rest[0]]
        return emit(func, _V(new), [dims.index(i) for i in range(len(dims))])
    scatters = {
        "slice.Tensor": aten.slice_scatter.default,
        "select.int": aten.select_scatter.default,
        "diagonal.default": aten.diagonal_scatter.default,
        "as_strided.default": aten.as_strided_scatter.default,
    }
    if name in scatters:
        return emit(scatters[name], _V(base), _V(new), *rest, **kwargs)
    if name == "expand.default":
        raise RuntimeError(
            "unsupported operation: more than one element of the written-to tensor refers to a single "
            "memory location. Please clone() the tensor before performing the operation."
        )
    raise NotImplementedError(f"in-place writes through a view made by {name} are not supported on the lazy device")


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


for _f in (aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int):
    HANDLERS[_f] = _split_views


# ---- in-place and out= ops -------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _written(func):
    """Return [(kind, key)] of the arguments `func` writes: ('pos', i) or ('kw', name)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out.append(("kw", arg.name) if arg.kwarg_only else ("pos", i))
    return out


@functools.lru_cache(maxsize=None)
def _functional_of(func):
    """Return the functional overload computing what `func` writes, or None."""
    name = func._schema.name.split("::")[1]
    overload = func._overloadname
    if name.endswith("_"):
        name = name[:-1]
        packet = getattr(aten, name, None)
        want = [(a.name, str(a.type)) for a in func._schema.arguments[1:]]
        pick = slice(1, None)  # transpose_.default vs transpose.int: match on the other arguments
        found = getattr(packet, overload, None) if packet is not None else None
        # Same overload name, same arguments: pow_.Scalar is pow.Tensor_Scalar, not pow.Scalar.
        if found is not None and [(a.name, str(a.type)) for a in found._schema.arguments[pick]] == want \
                and str(found._schema.arguments[0].type) == "Tensor":
            return found
    else:
        want = [(a.name, str(a.type)) for a in func._schema.arguments if not (a.alias_info and a.alias_info.is_write)]
        pick = slice(None)
    packet = getattr(aten, name, None)
    if packet is None:
        return None
    for ov in packet.overloads():
        cand = getattr(packet, ov)
        if cand is func or cand._schema.is_mutable:
            continue
        if [(a.name, str(a.type)) for a in cand._schema.arguments[pick]] == want and \
                (pick.start is None or str(cand._schema.arguments[0].type) == "Tensor"):
            return cand
    return None


def _mutating(func, args, kwargs):
    written = _written(func)
    fop = _functional_of(func)
    if len(written) != 1 or fop is None:
        return eager(func, args, kwargs)
    kind, key = written[0]
    target = args[key] if kind == "pos" else kwargs[key]
    if not isinstance(target, tensor.LazyTensor):
        return eager(func, args, kwargs)
    if fop.is_view:  # t_, transpose_, unsqueeze_, ...: the tensor becomes a new view of its storage
        target._assume(dispatch(fop, args, kwargs))
        return target
    fkwargs = {k: v for k, v in kwargs.items() if k != key} if kind == "kw" else kwargs
    result = dispatch(fop, args, fkwargs)
    if not _fits(result, target):  # PyTorch's own checks and errors for the in-place form
        if isinstance(result, tensor.LazyTensor) and not torch.can_cast(result.dtype, target.dtype):
            raise RuntimeError(f"result type {_type_name(result.dtype)} can't be cast to the desired output "
                               f"type {_type_name(target.dtype)}")  # meta kernels don't check it
        spec, _, metas = _collect(func, args, kwargs)
        try:
            out = shape.infer(func, spec, metas)
        except shape.NoMeta:
            return eager(func, args, kwargs)
        if out.metas and out.metas[0] is not None and out.metas[0].shape != target._sig[0]:
            return eager(func, args, kwargs)  # it changes the tensor's shape (resize_): PyTorch does that
    assign(target, result)
    return target


# In-place arithmetic, an optimizer's every update (buf.mul_(momentum), p.add_(buf, alpha=-lr),
# v.addcmul_(g, g, value=1 - beta2)): when every tensor operand has the target's shape and
# dtype and the scalars are plain numbers, the result has the target's meta, so the functional
# ops are recorded straight on IR values and written -- no result tensor, no nested dispatch.
# Anything else (broadcasting, type promotion, an expanded target) takes `_mutating`.
def _binary_inplace(fop, sign):
    def value(self, other, *, alpha=1):
        if alpha != 1:
            if type(other) is not tensor.LazyTensor:
                return None
            if _liftable(alpha):  # p.add_(buf, alpha=-lr): one node, self + other * alpha, the lr an input
                return _value_op(aten.addcmul.default, self, other, _scalar_input(sign * alpha, self._sig[2]))
            other = _value_op(aten.mul.Tensor, other, alpha)
        return _value_op(fop, self, other)

    return value


def _no_alpha(fop):
    def value(self, other):
        return _value_op(fop, self, other)

    return value


# in-place op -> (functional op, sign of its alpha; 0: it takes none)
_ELEMENTWISE_INPLACE = {
    aten.add_.Tensor: (aten.add.Tensor, 1),
    aten.sub_.Tensor: (aten.sub.Tensor, -1),
    aten.mul_.Tensor: (aten.mul.Tensor, 0),
    aten.div_.Tensor: (aten.div.Tensor, 0),
}
_INPLACE_ARITH = {
    **{f: _binary_inplace(fop, sign) if sign else _no_alpha(fop) for f, (fop, sign) in _ELEMENTWISE_INPLACE.items()},
    aten.addcmul_.default: functools.partial(_addcmul, last=_value_op),
    aten.addcdiv_.default: functools.partial(_addcdiv, last=_value_op),
    aten.lerp_.Scalar: functools.partial(_lerp_scalar, last=_value_op),
}
_INPLACE_RECIPES = {id(f): recipe for f, recipe in _INPLACE_ARITH.items()}  # by id, like _routes
_SIMPLE_INPLACE = {id(f): entry for f, entry in _ELEMENTWISE_INPLACE.items()}


def _inplace_arith(func, args, kwargs):
    target = args[0]
    if not _same_meta_operands(target, args, kwargs):
        return _mutating(func, args, kwargs)
    simple = _SIMPLE_INPLACE.get(id(func))
    if simple is not None and len(args) == 2 and not sync.unlowerable:
        value = _simple_inplace_value(simple, target, args[1], kwargs)
        if value is not None:
            target._write(value)
            return target
    value = _inplace_value(func, args, kwargs)
    if value is None:
        return _mutating(func, args, kwargs)
    if type(value) is _V:
        node, idx = value.value
        if node.metas[idx] == (target._sig[0], target.dtype):
            target._write(value.value)
            return target
        value = tensor.LazyTensor.from_value(value.value)
    assign(target, value)  # a step fell back to a tensor: assign checks and casts as _mutating does
    return target


def _inplace_value(func, args, kwargs):
    try:
        return _INPLACE_RECIPES[id(func)](*args, **kwargs)
    except TypeError:  # an argument the recipe doesn't take: the general path reports it
        return None


# The commonest of them -- SGD's buf.mul_(momentum), buf.add_(grad), p.add_(buf, alpha=-lr) --
# written out: the same decisions as the recipes above (lifted scalars, addcmul for a float
# alpha), recorded as one node with the target's meta and no shape inference (operands of
# the target's shape and dtype, checked by _same_meta_operands, keep both): ~3 us less per op.
# Anything else (an int scalar, 0 or 1, an int alpha) is left to the recipes.
def _simple_inplace_value(simple, target, other, kwargs):
    """The IR value of `target <op>= other`, or None where the recipe must decide."""
    fop, sign = simple
    alpha = 1
    if kwargs:
        if not sign or len(kwargs) != 1 or "alpha" not in kwargs:
            return None
        alpha = kwargs["alpha"]
    t = type(other)
    if t is tensor.LazyTensor:
        if alpha == 1:
            op, spec = fop, _BINARY_SPEC
            inputs = (target._value(), other._value())
        elif type(alpha) is float and _liftable(alpha):
            op, spec = aten.addcmul.default, _TERNARY_SPEC
            inputs = (target._value(), other._value(), _scalar_input(sign * alpha, target._sig[2]).value)
        else:
            return None
    elif t is float and alpha == 1 and _liftable(other):
        op, spec = fop, _BINARY_SPEC
        inputs = (target._value(), _scalar_input(other, _lifted_dtype(fop, target._sig[2])).value)
    else:
        return None
    counter = _lowered_counter(op)
    if counter is None:
        return None
    node, idx = inputs[0]
    metrics.counts[counter] += 1
    return (Node(op, spec, inputs, (node.metas[idx],)), 0)


def _same_meta_operands(target, args, kwargs) -> bool:
    if type(target) is not tensor.LazyTensor:
        return False
    shape, strides, dtype = target._sig
    if not dtype.is_floating_point or 0 in strides:
        return False
    for i in range(1, len(args)):
        x = args[i]
        t = type(x)
        if t is tensor.LazyTensor:
            sig = x._sig
            if sig[0] != shape or sig[2] != dtype:
                return False
        elif t is not float and t is not int:
            return False
    for v in kwargs.values():
        if type(v) is not float and type(v) is not int:
            return False
    return True


for _f in _INPLACE_ARITH:
    HANDLERS[_f] = _inplace_arith


def _type_name(dtype) -> str:
    """PyTorch's ScalarType name of a dtype, as its error messages spell it (torch.int64: Long)."""
    return _TYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


_TYPE_NAMES = {
    torch.float64: "Double", torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16",
    torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
    torch.bool: "Bool", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
}


def _fits(result, target) -> bool:
    """Whether `result` can be written into `target` as is: same shape and dtype, and no
    element of target aliases another (an expanded tensor, stride 0)."""
    return isinstance(result, tensor.LazyTensor) and result._sig[0] == target._sig[0] \
        and result.dtype == target.dtype and 0 not in target._sig[1]


def assign(target, result):
    """Write the lazy tensor `result` into `target` (same shape), casting to target's dtype."""
    if tuple(result.shape) != tuple(target.shape):
        raise RuntimeError(
            f"output with shape {list(target.shape)} doesn't match the broadcast shape {list(result.shape)}"
        )
    if result.dtype != target.dtype:
        result = dispatch(aten._to_copy.default, (result,), {"dtype": target.dtype})
    target._write(result._value())


@handles(aten.copy_.default)
def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(dst, tensor.LazyTensor):
        dst.copy_(src._to_cpu())
        return dst
    if not isinstance(src, tensor.LazyTensor):
        src = tensor.LazyTensor.from_cpu(src)
    if src.dtype != dst.dtype:
        src = aten._to_copy.default(src, dtype=dst.dtype)
    if tuple(src.shape) != tuple(dst.shape):
        src = aten.expand.default(src, list(dst.shape))
    dst._write(src._value())
    return dst


# ---- constant fills -----------------------------------------------------------------
# A whole tensor filled with a constant (torch.zeros/ones/full on the lazy device, which
# are empty + fill_; zeros_like, new_zeros and their kin; x.zero_()) is device data at
# once, not a graph node, except inside autograd's backward. Optimizer state starts this
# way (AdamW's exp_avg = zeros_like(p), a `total = torch.zeros(())` accumulator): as a
# node, the first step's graph computed the state where every later step's reads it as
# an input, so training compiled two programs where one does. Inside the backward, zeros
# are intermediates (index and gather gradients scatter into them) that the program
# makes in a fused kernel: they stay nodes, and so do the fills ratex's own
# decompositions make (they call `_functional` directly).
def _constant_data(shape, value, dtype):
    """The IR value of fresh device data of `shape` and `dtype` holding `value` everywhere."""
    shape = tuple(shape)
    metrics.counter_inc("DeviceDataTransfer")
    data = tensor.backend().full(shape, value, dtype)
    return (Node.leaf(data, ir.Meta(shape, dtype)), 0)


def _as_data(value) -> bool:
    """Whether a fill with `value` becomes data: a plain number, outside autograd's backward."""
    return type(value) in (int, float, bool) and torch._C._current_autograd_node() is None


@handles(aten.zero_.default, aten.fill_.Scalar)
def _fill_(func, args, kwargs):
    self = args[0]
    value = 0 if func is aten.zero_.default else args[1]
    if not self._chain and _as_data(value):  # the whole storage
        self._write(_constant_data(self.shape, value, self.dtype))
        return self
    full = _functional(aten.full.default, (list(self.shape), value), {"dtype": self.dtype})
    self._write(full._value())  # through the view chain into the base
    return self


# op -> (fill value, or None: argument 1; where its size argument is, or None: the input's)
_FILLS = {
    aten.zeros_like.default: (0, None), aten.ones_like.default: (1, None), aten.full_like.default: (None, None),
    aten.new_zeros.default: (0, 1), aten.new_ones.default: (1, 1), aten.new_full.default: (None, 1),
}


@handles(*_FILLS)
def _fill_new(func, args, kwargs):
    value, size_at = _FILLS[func]
    self = args[0]
    if value is None:
        value = args[2] if size_at is not None else args[1]
    memory_format = kwargs.get("memory_format")
    device = kwargs.get("device")
    plain = (
        _as_data(value)
        and kwargs.get("layout") in (None, torch.strided)
        and not kwargs.get("pin_memory")
        and (device is None or torch.device(device).type == "lazy")
        # the result's strides are contiguous: so are the input's, or the call asks for that
        and (size_at is not None or memory_format is torch.contiguous_format
             or (memory_format in (None, torch.preserve_format) and self.is_contiguous()))
    )
    if not plain:
        return _functional(func, args, kwargs)
    shape = args[size_at] if size_at is not None else self.shape
    return tensor.LazyTensor.from_value(_constant_data(shape, value, kwargs.get("dtype") or self.dtype))


@handles(aten.fill_.Tensor)
def _fill_tensor_(func, args, kwargs):
    self, value = args[0], args[1]
    _copy_(aten.copy_.default, (self, value), {})
    return self


@handles(aten._to_copy.default)
def _to_copy(func, args, kwargs):
    device = kwargs.get("device")
    if device is not None and torch.device(device).type != "lazy":
        return func(args[0]._to_cpu(), **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "pin_memory", "non_blocking", "layout")}
    if not kwargs.get("dtype") or kwargs.get("dtype") == args[0].dtype:
        kwargs.pop("memory_format", None)
    return _functional(func, args, kwargs)


@handles(aten._local_scalar_dense.default, aten.item.default)
def _item(func, args, kwargs):
    return args[0]._to_cpu().item()


@handles(aten.clone.default)
def _clone(func, args, kwargs):
    # Device data is immutable, so a clone is the same value in a new Storage. With buffer
    # donation the step that overwrites the source may write into its buffer, so the
    # clone must own a copy (see Program.run, which gives every output a buffer of its own).
    # Either way the clone's strides are PyTorch's for its memory_format (preserve: a
    # transposed source gives a transposed clone; contiguous_format, as reshape asks for
    # when it can't view, a contiguous one).
    if config.PARAM_ALIASING:
        return _functional(func, args, kwargs)
    spec, _, metas = _collect(func, args, kwargs)
    out = shape.infer(func, spec, metas)
    return tensor.LazyTensor.from_value(args[0]._value(), out.strides[0], out.offsets[0])


# ---- PyTorch's decompositions: the tier between a lowering rule and the CPU -------
_decomposing = set()  # ops whose decomposition is running (one that re-emits its own op runs it eagerly)


@functools.lru_cache(maxsize=None)
def _composite(func) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


@functools.lru_cache(maxsize=None)
def _torch_decomp(func):
    """PyTorch's decomposition of `func`, or None (random ops keep their own seeded path).

    torch._decomp's table first; else the op's CompositeImplicitAutograd kernel,
    for composite ops that reach the lazy device from inside another decomposition.
    """
    if torch.Tag.nondeterministic_seeded in func.tags:
        return None
    found = torch._decomp.decomposition_table.get(func)
    if found is None and _composite(func):
        found = func.decompose
    return found


def _decomposed_or_eager(func, args, kwargs, out):
    """Trace `func` through PyTorch's decomposition into simpler ops, else run it eagerly."""
    result = _decomposed(func, args, kwargs, out)
    return eager(func, args, kwargs) if result is NotImplemented else result


def _decomposed(func, args, kwargs, out):
    """`func` traced through its decomposition, or NotImplemented where it has none that works.

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
        if not isinstance(r, tensor.LazyTensor) or tuple(r.shape) != m.shape or r.dtype != m.dtype:
            return False
    return True


# The refs among those decompositions are written with prims; these are their ATen equivalents.
prims = torch.ops.prims


def _prims_div(a, b):
    if a.dtype.is_floating_point or a.dtype.is_complex:
        return aten.div.Tensor(a, b)
    return aten.div.Tensor_mode(a, b, rounding_mode="trunc")


def _prims_broadcast_in_dim(a, shape, broadcast_dimensions):
    sizes = [1] * len(shape)
    for size, d in zip(a.shape, broadcast_dimensions):
        sizes[d] = size
    return aten.expand.default(aten.view.default(a, sizes), list(shape))


def _prims_var(a, dims, correction=1, *, output_dtype=None):
    return aten.var.correction(a, dims, correction=correction)


def _prims_sum(a, dims, *, output_dtype=None):
    return aten.sum.dim_IntList(a, dims, dtype=output_dtype)


DECOMPS.update({
    prims.where.default: aten.where.self,
    prims.div.default: _prims_div,
    prims.broadcast_in_dim.default: _prims_broadcast_in_dim,
    prims.var.default: _prims_var,
    prims.sum.default: _prims_sum,
    prims.convert_element_type.default: lambda a, dtype: aten._to_copy.default(a, dtype=dtype),
})


# ---- eager fallback --------------------------------------------------------------
def eager(func, args, kwargs):
    """Run `func` on CPU PyTorch with materialized inputs; results come back as device data."""
    metrics.counter_inc(f"aten::{op_name(func)}")
    copies = {}

    def to_cpu(x):
        if type(x) is _V:  # an intermediate value of a decomposition
            x = tensor.LazyTensor.from_value(x.value)
        if isinstance(x, tensor.LazyTensor):
            c = x._to_cpu()
            copies[id(c)] = x
            return c
        if isinstance(x, torch.device) and x.type == "lazy":
            return torch.device("cpu")
        return x

    cpu_args = [_map(to_cpu, a) for a in args]
    cpu_kwargs = {k: _map(to_cpu, v) for k, v in kwargs.items()}
    out = func(*cpu_args, **cpu_kwargs)
    for kind, key in _written(func):
        cpu = cpu_args[key] if kind == "pos" else cpu_kwargs.get(key)
        for c in cpu if isinstance(cpu, (list, tuple)) else [cpu]:
            if isinstance(c, torch.Tensor) and id(c) in copies:
                lazy, new = copies[id(c)], tensor.LazyTensor.from_cpu(c)
                if tuple(new.shape) == tuple(lazy.shape) and new.dtype == lazy.dtype:
                    lazy._write(new._value())
                else:  # the op changed the tensor's metadata (resize_, set_, ...)
                    lazy._assume(new)

    def back(o):
        if isinstance(o, torch.Tensor):
            orig = copies.get(id(o))
            return orig if orig is not None else tensor.LazyTensor.from_cpu(o)
        return o

    return _map(back, out)


def _map(fn, x):
    if isinstance(x, (list, tuple)):
        return type(x)(_map(fn, y) for y in x)
    return fn(x)



@handles(aten.native_batch_norm.default)
def _native_batch_norm(func, args, kwargs):
    """native_batch_norm updates running stats in place without saying so in its schema."""
    names = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps")
    a = dict(zip(names, args), **kwargs)
    out = _functional(func, args, kwargs)
    rm, rv = a["running_mean"], a["running_var"]
    if a["training"] and rm is not None and rv is not None:
        x, momentum = a["input"], a["momentum"]
        dims = [0] + list(range(2, x.dim()))
        mean = aten.mean.dim(x, dims)
        var = aten.var.correction(x, dims, correction=1)
        assign(rm, aten.add.Tensor(aten.mul.Tensor(rm, 1 - momentum), aten.mul.Tensor(mean, momentum)))
        assign(rv, aten.add.Tensor(aten.mul.Tensor(rv, 1 - momentum), aten.mul.Tensor(var, momentum)))
    if not a["training"]:  # PyTorch's CPU kernel saves no statistics in eval mode (its meta kernel says [C])
        empty = torch.empty(0, dtype=out[1].dtype)
        out = (out[0], tensor.LazyTensor.from_cpu(empty), tensor.LazyTensor.from_cpu(empty))
    return out


# ---- backward helpers PyTorch emits that are scatters into zeros ------------------------
def _zeros(sizes, like):
    return _functional(aten.full.default, (list(sizes), 0), {"dtype": like.dtype})


def _select_backward(grad, input_sizes, dim, index):
    return aten.select_scatter.default(_zeros(input_sizes, grad), grad, dim, index)


def _slice_backward(grad, input_sizes, dim, start, end, step):
    return aten.slice_scatter.default(_zeros(input_sizes, grad), grad, dim, start, end, step)


def _safe_softmax(x, dim, dtype=None):
    """softmax, but 0 (not NaN) for rows that are entirely -inf (masked-out attention rows)."""
    out = aten._softmax.default(x if dtype is None else aten._to_copy.default(x, dtype=dtype), dim, False)
    masked = aten.eq.Scalar(aten.amax.default(x, [dim], True), float("-inf"))
    return aten.where.self(masked, _functional(aten.zeros_like.default, (out,), {}), out)


DECOMPS.update({
    aten.select_backward.default: _select_backward,
    aten.slice_backward.default: _slice_backward,
    aten._safe_softmax.default: _safe_softmax,
})
HANDLERS[aten.unsafe_split.Tensor] = _split_views
HANDLERS[aten.tensor_split.sections] = _split_views
HANDLERS[aten.unsafe_split_with_sizes.default] = _split_views


@handles(aten._has_compatible_shallow_copy_type.default)
def _shallow_copy_compatible(func, args, kwargs):
    """Autograd asks this when it replaces a tensor's data: a metadata question, no values needed."""
    return isinstance(args[0], tensor.LazyTensor) == isinstance(args[1], tensor.LazyTensor)


@handles(aten.arange.out, aten.arange.start_out)
def _arange_out(func, args, kwargs):
    """arange into a lazy `out` (what torch.arange(device='lazy') becomes): a factory, made on CPU."""
    out = kwargs["out"]
    new = tensor.LazyTensor.from_cpu(func(*args, out=torch.empty(0, dtype=out.dtype)), adopt=True)
    if tuple(new.shape) == tuple(out.shape):
        out._write(new._value())
    else:
        out._assume(new)
    return out

