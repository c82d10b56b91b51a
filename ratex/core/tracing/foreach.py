"""Foreach ops (what optimizers call), and foreach by default for optimizers of lazy parameters.

`_foreach_op(lists...)` means `op` per element. Elementwise arithmetic whose tensor operands
all have the element's shape and float dtype, with Python numbers as scalars (an optimizer's
update of each parameter), keeps that meta, so it is recorded straight as IR nodes: no shape
inference, no tensor for an intermediate, no dispatch per element. Any other element, and
any other foreach op, is dispatched as `op` on that element.

torch.optim picks its foreach implementation by default only on devices it lists (CUDA and
the like), and a LazyTensor is not one of its tensor types; `import ratex` registers a global
optimizer step pre-hook (torch's public hook API) that runs a step whose parameters are all
lazy with foreach, as it would run on CUDA, unless the group chose (foreach or fused) itself.
"""
import torch
import torch.optim.optimizer as optim_hooks

from .. import metrics
from ..ir import Meta, Node, float_atom, slot
from ..shape import contiguous_strides
from ..tensor import LazyTensor
from . import registry
from .capture import BINARY_SPEC, NO_KWARGS, TERNARY_SPEC
from .decompose import lerp_formula
from .eager import run as eager, unlowerable
from .record import liftable, lowered_counter, scalar_input
from .registry import PATH, register

aten = torch.ops.aten


@register("foreach", tier=PATH)
def foreach(func, args, kwargs):
    """Trace `_foreach_op(lists...)` as `op` applied per element; return the list of results
    (None for the in-place forms)."""
    plan = _PLANS.get(id(func))
    if plan is not None and not unlowerable:
        return _recorded(plan, func, args, kwargs)
    return _per_element(func, args, kwargs)


def _per_element(func, args, kwargs, only=None):
    """Dispatch `op` on each element (those in `only`, if given); return the results as `foreach` does."""
    name = func._schema.name.split("::")[1][len("_foreach_"):]
    if not hasattr(aten, name):  # maximum_, minimum_: no in-place op per tensor, so its functional one, copied in
        functional_ = getattr(torch, name[:-1])
        targets = args[0]
        indices = range(len(targets)) if only is None else only
        for i in indices:
            rest = [a[i] if isinstance(a, (list, tuple)) else a for a in args[1:]]
            targets[i].copy_(functional_(targets[i], *rest, **kwargs))
        return None
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
        if isinstance(scalars, LazyTensor):
            return eager(func, *call)  # per-element Python scalars would need a sync
        kwargs = {**kwargs, "value": scalars.tolist()}

    def pick(a, i):
        return a[i] if isinstance(a, (list, tuple)) and len(a) == n else a

    # The overload torch would pick per element, where it is known: calling ratex's own route
    # for it skips torch's dispatcher (a round trip into a Python subclass per element). The
    # elements are all lazy tensors, so the call would have come straight back here anyway.
    element = _FOREACH_ELEMENT.get(name, {}).get(func._overloadname)
    if element is not None and all(type(t) is LazyTensor for t in call[0][0]):
        op = getattr(per_op, element)
        dispatch = registry.dispatch
        run = lambda a, k: dispatch(op, a, k)  # noqa: E731
    else:
        run = lambda a, k: per_op(*a, **k)  # noqa: E731
    indices = range(n) if only is None else only
    results = [run([pick(a, i) for a in args], {k: pick(v, i) for k, v in kwargs.items()}) for i in indices]
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


# ---- elementwise arithmetic recorded as nodes ----------------------------------------------
# Each builder takes the element's IR value `x`, its Meta, and the element's other operands
# (IR values of same-meta tensors, Python numbers), and returns the IR value of the result,
# made of the nodes ratex's per-element route records for the same call (decompose.py,
# inplace.py): lifted float scalars, addcmul for a float alpha.
_ADD, _SUB, _MUL, _DIV = aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor
_ADDCMUL = aten.addcmul.default
_UNARY_SPEC = ((slot(0),), NO_KWARGS)
_counts = metrics.counts


def _node(op, spec, inputs, meta):
    """The value of a new node of `op` (which has a lowering rule) whose output has `meta`."""
    _counts[_COUNTERS[op]] += 1
    return (Node(op, spec, inputs, (meta,)), 0)


def _with_scalar(op, x, s, meta):
    """op(x, s) for a Python number `s`: a float that changes every step is an input (see
    record.lift_scalar, which also lifts x * 0: folding it would lose NaN * 0 = NaN)."""
    if liftable(s) or (op is _MUL and s == 0):
        return _node(op, BINARY_SPEC, (x, _lifted(s, meta.dtype)), meta)
    return _node(op, ((_SLOT0, float_atom(s) if type(s) is float else s), NO_KWARGS), (x,), meta)


def _lifted(s, dtype):
    """The IR value of the graph input holding `s` as a 0-dim `dtype` tensor: one look-up in
    record.scalar_input per scalar of a call, not per element (an optimizer passes the same lr
    for every parameter)."""
    key = (float_atom(s) if type(s) is float else s, type(s), dtype)  # -0.0 apart from 0.0, 1 from 1.0
    value = _call_scalars.get(key)
    if value is None:
        value = _call_scalars[key] = scalar_input(s, dtype).value
    return value


_call_scalars = {}  # (scalar, type, dtype) -> IR value, for the foreach call being recorded


_SLOT0 = slot(0)


def _add_alpha(op, sign):
    def build(x, meta, other, alpha=1):
        if type(other) is not tuple:  # the .Scalar/.ScalarList overloads: x op s
            return _with_scalar(op, x, other, meta)
        if alpha == 1:
            return _node(op, BINARY_SPEC, (x, other), meta)
        if liftable(alpha):  # x + other * (sign * alpha): one node, alpha an input
            return _node(_ADDCMUL, TERNARY_SPEC, (x, other, _lifted(sign * alpha, meta.dtype)), meta)
        return _node(op, BINARY_SPEC, (x, _with_scalar(_MUL, other, alpha, meta)), meta)

    return build


def _binary(op):
    def build(x, meta, other):
        if type(other) is not tuple:
            return _with_scalar(op, x, other, meta)
        return _node(op, BINARY_SPEC, (x, other), meta)

    return build


def _scaled(v, value, meta):
    return v if value == 1 and type(value) is int else _with_scalar(_MUL, v, value, meta)


def _addcmul(x, meta, t1, t2, value=1):
    """x + t1 * value * t2, as decompose.addcmul records it."""
    return _node(_ADD, BINARY_SPEC, (x, _node(_MUL, BINARY_SPEC, (_scaled(t1, value, meta), t2), meta)), meta)


def _addcdiv(x, meta, t1, t2, value=1):
    """x + t1 / t2 * value, as decompose.addcdiv records it."""
    quotient = _node(_DIV, BINARY_SPEC, (t1, t2), meta)
    return _node(_ADD, BINARY_SPEC, (x, _scaled(quotient, value, meta)), meta)


def _lerp(x, meta, end, weight):
    """torch's lerp of x and end by the number `weight`, as decompose.lerp_scalar records it."""
    small, w = lerp_formula(weight, meta.dtype)
    diff = _node(_SUB, BINARY_SPEC, (end, x), meta)
    return _node(_ADD if small else _SUB, BINARY_SPEC, (x if small else end, _with_scalar(_MUL, diff, w, meta)), meta)


def _unary(op):
    def build(x, meta):
        return _node(op, _UNARY_SPEC, (x,), meta)

    return build


_BUILDERS = {
    "add": _add_alpha(_ADD, 1), "sub": _add_alpha(_SUB, -1), "mul": _binary(_MUL), "div": _binary(_DIV),
    "addcmul": _addcmul, "addcdiv": _addcdiv, "lerp": _lerp,
    "sqrt": _unary(aten.sqrt.default), "neg": _unary(aten.neg.default), "reciprocal": _unary(aten.reciprocal.default),
}
_OVERLOADS = {
    "add": ("Scalar", "List", "ScalarList"), "sub": ("Scalar", "List", "ScalarList"),
    "mul": ("Scalar", "List", "ScalarList"), "div": ("Scalar", "List", "ScalarList"),
    "addcmul": ("Scalar", "ScalarList"), "addcdiv": ("Scalar", "ScalarList"), "lerp": ("Scalar", "ScalarList"),
    "sqrt": ("default",), "neg": ("default",), "reciprocal": ("default",),
}
_NUMBERS = (int, float)  # exactly: a bool scalar or a complex one may change the result's dtype


class _Plan:
    """How one foreach overload is recorded: its builder, whether it writes `self`, and for each
    argument after `self` in schema order its role: 'tensors', 'scalars' (one per element) or
    'scalar', with its default."""

    __slots__ = ("build", "inplace", "roles", "names", "defaults")

    def __init__(self, func, build):
        self.build = build
        self.inplace = func._schema.name.endswith("_")
        rest = func._schema.arguments[1:]
        self.roles = tuple(_role(a.type) for a in rest)
        self.names = tuple(a.name for a in rest)
        self.defaults = tuple(a.default_value if a.has_default_value() else _REQUIRED for a in rest)


_REQUIRED = object()


def _role(typ) -> str:
    """An argument's role in a foreach call, from its schema type: a list of tensors, a list of
    scalars (one per element), or one scalar for every element."""
    if not isinstance(typ, torch._C.ListType):
        return "scalar"
    return "tensors" if isinstance(typ.getElementType(), torch._C.TensorType) else "scalars"


def _bind(plan, func, args, kwargs):
    """The arguments after `self` in schema order, or None where the call isn't a plain one."""
    given = list(args[1:])
    if len(given) > len(plan.names):
        return None
    for name, default in zip(plan.names[len(given):], plan.defaults[len(given):]):
        value = kwargs.get(name, default)
        if value is _REQUIRED:
            return None
        given.append(value)
    if len(kwargs) > sum(name in kwargs for name in plan.names):
        return None  # an argument the op doesn't take: the per-element route reports it
    return given


def _recorded(plan, func, args, kwargs):
    """`foreach` for an overload with a plan: elements whose operands fit are recorded as nodes,
    the others dispatched per element, in list order (a later element may read an earlier
    one's target)."""
    targets = args[0]
    rest = _bind(plan, func, args, kwargs)
    if rest is None or not isinstance(targets, (list, tuple)):
        return _per_element(func, args, kwargs)
    n = len(targets)
    for role, value in zip(plan.roles, rest):
        if role != "scalar" and (not isinstance(value, (list, tuple)) or len(value) != n):
            what = "tensors" if role == "tensors" else "scalars"
            got = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
            raise RuntimeError(f"{func}: every list must have {n} elements, as `self` has; got {got} {what}")
    build, inplace, roles = plan.build, plan.inplace, plan.roles
    results = None if inplace else [None] * n
    _call_scalars.clear()  # this call's only: the next may run under another backend
    for i in range(n):
        x = targets[i]
        operands = _operands(x, roles, rest, i, inplace)
        if operands is None:
            out = _per_element(func, args, kwargs, only=(i,))
            if not inplace:
                results[i] = out[0]
            continue
        meta = Meta(x._sig[0], x._sig[2])
        value = build(x._value(), meta, *operands)
        if inplace:
            x._write(value)
        else:
            results[i] = LazyTensor.from_value(value)
    return results


def _operands(x, roles, rest, i, inplace):
    """Element i's operands after `x` (tensors as IR values), or None where the element must
    take the per-element route: `x` is not a float lazy tensor, a tensor operand has another
    shape or dtype, a scalar is not a plain number; in place, `x` is expanded (PyTorch refuses
    the write); out of place, a tensor is not contiguous (PyTorch's result would follow its
    strides)."""
    if type(x) is not LazyTensor:
        return None
    shape, strides, dtype = x._sig
    if not dtype.is_floating_point:
        return None
    if inplace:
        if 0 in strides:
            return None
    else:
        strides = contiguous_strides(shape)
        if x._sig[1] != strides:
            return None
    out = []
    for role, value in zip(roles, rest):
        item = value if role == "scalar" else value[i]
        t = type(item)
        if t is LazyTensor:
            sig = item._sig
            if sig[0] != shape or sig[2] != dtype or (not inplace and sig[1] != strides):
                return None
            out.append(item._value())
        elif t in _NUMBERS:
            out.append(item)
        else:
            return None
    return out


def _plans():
    """id(overload) -> _Plan for the foreach overloads recorded as nodes (in place or not)."""
    plans = {}
    for name, build in _BUILDERS.items():
        for tail in ("", "_"):
            packet = getattr(aten, f"_foreach_{name}{tail}")
            for overload in _OVERLOADS[name]:
                func = getattr(packet, overload, None)
                if func is not None:
                    plans[id(func)] = _Plan(func, build)
                    _kept.append(func)  # its id stays valid
    return plans


_kept = []
_COUNTERS = {op: lowered_counter(op) for op in (_ADD, _SUB, _MUL, _DIV, _ADDCMUL, aten.sqrt.default,
                                               aten.neg.default, aten.reciprocal.default)}
_PLANS = _plans() if all(_COUNTERS.values()) else {}  # every op lowers: else the per-element route decides


# ---- foreach by default -------------------------------------------------------------------
# torch.optim's `_default_to_fused_or_foreach` picks foreach only for the devices torch lists
# (CUDA, XPU, MTIA, the PrivateUse1 backend) and only for plain Tensors and Parameters; the
# lazy device is neither, so optimizers of lazy parameters ran their single-tensor loops, a
# dispatch into Python per op per parameter. A global step pre-hook turns foreach on for the
# step where torch would have decided (the group says None, nothing fused or differentiable)
# and every parameter is lazy; the post-hook puts None back, so the optimizer's state_dict
# and param_groups read as the user made them.
_switched = []  # the groups this step runs with foreach, to put back after it


def _foreach_on_lazy(optimizer, args, kwargs):
    _restore()  # a step that raised never reached the post-hook
    for group in optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None and not group.get("fused") \
                and not group.get("differentiable") and group["params"] \
                and all(type(p) is LazyTensor for p in group["params"]):
            group["foreach"] = True
            _switched.append(group)


def _restore(optimizer=None, args=None, kwargs=None):
    while _switched:
        _switched.pop()["foreach"] = None


optim_hooks.register_optimizer_step_pre_hook(_foreach_on_lazy)
optim_hooks.register_optimizer_step_post_hook(_restore)
