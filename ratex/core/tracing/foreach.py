"""Foreach ops (what optimizers call): `_foreach_op(lists...)` traced as `op` per element."""
import torch

from ..tensor import LazyTensor
from . import registry
from .eager import run as eager
from .registry import PATH, register

aten = torch.ops.aten


@register("foreach", tier=PATH)
def foreach(func, args, kwargs):
    """Trace `_foreach_op(lists...)` as `op` applied per element; return the list of results
    (None for the in-place forms)."""
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
