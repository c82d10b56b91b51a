"""Argument capture: an ATen call's arguments as (spec, input values, input metas), devices checked.

The spec is the hashable argument template of an IR node (tensors replaced by
slots, see ir.template); the input values are the tensors' IR values, the input
metas what shape inference keys on. Internal steps pass IR values without a
LazyTensor around them, wrapped in `Value`.
"""
import torch

from .. import ir
from ..ir import template
from ..shape import contiguous_strides
from ..tensor import LazyTensor, check_device

aten = torch.ops.aten
_DEVICE_KWARGS = ("device", "pin_memory")


class Value:
    """An IR value passed where a tensor argument goes, for ops emitted internally."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


_ARG_TENSOR_TYPES = (torch.Tensor, Value)


def is_arg_tensor(x) -> bool:
    """Return whether `x` is a tensor argument: a tensor or a `Value`."""
    return isinstance(x, _ARG_TENSOR_TYPES)


NO_KWARGS = ("__dict__", ())
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
    return template(x, found, is_arg_tensor)


def collect(func, args, kwargs):
    """Return (spec, input values, input metas) for a call, checking devices."""
    if not kwargs:
        n = len(args)
        if n == 1 and type(args[0]) is LazyTensor:  # relu(x)
            x = args[0]
            return UNARY_SPEC, [x._st.value if not x._chain else x._value()], (x._sig,)
        if n == 2 and is_value_arg(args[0]) and is_value_arg(args[1]):  # x + y
            return BINARY_SPEC, [arg_value(args[0]), arg_value(args[1])], (arg_sig(args[0]), arg_sig(args[1]))
        if n == 3 and is_value_arg(args[0]) and is_value_arg(args[1]) and is_value_arg(args[2]):  # addcmul(p, buf, lr)
            return TERNARY_SPEC, [arg_value(a) for a in args], tuple([arg_sig(a) for a in args])
    elif "device" in kwargs or "pin_memory" in kwargs:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "lazy":
            check_device(device)
        kwargs = {k: v for k, v in kwargs.items() if k not in _DEVICE_KWARGS}
    found = []
    spec = (
        tuple([_tmpl(a, found) for a in args]),
        ("__dict__", tuple([(k, _tmpl(v, found)) for k, v in kwargs.items()])) if kwargs else NO_KWARGS,
    )
    values, metas = [], []
    for t in found:
        if type(t) is LazyTensor:  # the usual case, as below
            values.append(t._st.value if not t._chain else t._value())
            metas.append(t._sig)
            continue
        if isinstance(t, Value):
            values.append(t.value)
            metas.append(arg_sig(t))
            continue
        if not isinstance(t, LazyTensor):
            if t.device.type == "cpu" and (t.dim() == 0 or func in _CPU_INDICES_OK):
                t = LazyTensor.from_cpu(t)  # like CUDA: 0-dim CPU tensors are scalars
            else:
                raise RuntimeError(
                    f"Expected all tensors to be on the same device, but found at least two devices, "
                    f"lazy:0 and {t.device}! (when checking arguments for {func}; move the {t.device} "
                    f"tensor of shape {tuple(t.shape)} to the lazy device with .to('lazy'))"
                )
        values.append(t._value())
        metas.append(t._sig)
    return spec, values, tuple(metas)


UNARY_SPEC = ((ir.slot(0),), NO_KWARGS)  # what `collect` makes of f(tensor)
BINARY_SPEC = ((ir.slot(0), ir.slot(1)), NO_KWARGS)  # what `collect` makes of f(tensor, tensor)
TERNARY_SPEC = ((ir.slot(0), ir.slot(1), ir.slot(2)), NO_KWARGS)


def is_value_arg(x) -> bool:
    """Return whether `x` is a lazy tensor or a `Value` (exactly: not a subclass)."""
    t = type(x)
    return t is Value or t is LazyTensor


def arg_value(x):
    """Return the IR value of a lazy tensor or a `Value`."""
    return x.value if type(x) is Value else x._value()


def arg_sig(x):
    """Return (shape, strides, dtype) of a lazy tensor or an IR value, as `collect` gives it."""
    if type(x) is not Value:
        return x._sig
    meta = x.value[0].metas[x.value[1]]
    return meta.shape, contiguous_strides(meta.shape), meta.dtype
