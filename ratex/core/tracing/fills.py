"""Fills and copies: constant fills, copies between tensors and devices, clones, reads of a value.

A whole tensor filled with a constant (torch.zeros/ones/full on the lazy device, which
are empty + fill_; zeros_like, new_zeros and their kin; x.zero_()) is device data at
once, not a graph node, except inside autograd's backward. Optimizer state starts this
way (AdamW's exp_avg = zeros_like(p), a `total = torch.zeros(())` accumulator): as a
node, the first step's graph computed the state where every later step's reads it as
an input, so training compiled two programs where one does. Inside the backward, zeros
are intermediates (index and gather gradients scatter into them) that the program
makes in a fused kernel: they stay nodes, and so do the fills ratex's own
decompositions make (they call `record.functional` directly).
"""
import torch
from torch.nn.parameter import UninitializedTensorMixin

from ... import config
from .. import ir, metrics, shape
from ..device import backend
from ..ir import Node
from ..tensor import LazyTensor, check_device, uninitialized_like
from .capture import collect
from .record import functional
from .registry import HANDLER, register

aten = torch.ops.aten


# ---- copies ----------------------------------------------------------------------------------
@register(aten.copy_.default, tier=HANDLER)
def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(dst, LazyTensor):
        dst.copy_(src._to_cpu())
        return dst
    if not isinstance(src, LazyTensor):
        src = LazyTensor.from_cpu(src)
    if src.dtype != dst.dtype:
        src = aten._to_copy.default(src, dtype=dst.dtype)
    if tuple(src.shape) != tuple(dst.shape):
        src = aten.expand.default(src, list(dst.shape))
    dst._write(src._value())
    return dst


@register(aten._to_copy.default, tier=HANDLER)
def _to_copy(func, args, kwargs):
    device = kwargs.get("device")
    if isinstance(args[0], UninitializedTensorMixin):
        return _uninitialized_to(args[0], device, kwargs.get("dtype"))
    if device is not None and torch.device(device).type != "lazy":
        return func(args[0]._to_cpu(), **kwargs)
    if device is not None:
        check_device(device)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "pin_memory", "non_blocking", "layout")}
    if not kwargs.get("dtype") or kwargs.get("dtype") == args[0].dtype:
        kwargs.pop("memory_format", None)
    return functional(func, args, kwargs)


def _uninitialized_to(src, device, dtype):
    """A Lazy* module's uninitialized parameter or buffer cast on the lazy device stays uninitialized.

    Moved off the lazy device it would come back initialized and empty (Module._apply wraps a
    CPU result in a new Parameter), a module that then fails later and far from here: refused.
    """
    if device is not None and torch.device(device).type != "lazy":
        raise RuntimeError(
            f"cannot move an uninitialized {'parameter' if isinstance(src, torch.nn.Parameter) else 'buffer'} "
            "of a torch.nn Lazy* module from the "
            f"lazy device to {torch.device(device)}: it has no shape until the module's first call; call the "
            "module once on a lazy batch first")
    if device is not None:
        check_device(device)
    return uninitialized_like(src, dtype or src.dtype)


@register(aten.clone.default, tier=HANDLER)
def _clone(func, args, kwargs):
    # Device data is immutable, so a clone is the same value in a new Storage. With buffer
    # donation the step that overwrites the source may write into its buffer, so the
    # clone must own a copy (see Program.run, which gives every output a buffer of its own).
    # Either way the clone's strides are PyTorch's for its memory_format (preserve: a
    # transposed source gives a transposed clone; contiguous_format, as reshape asks for
    # when it can't view, a contiguous one).
    if config.PARAM_ALIASING:
        return functional(func, args, kwargs)
    spec, _, metas = collect(func, args, kwargs)
    out = shape.infer(func, spec, metas)
    return LazyTensor.from_value(args[0]._value(), out.strides[0], out.offsets[0])


@register(aten._local_scalar_dense.default, aten.item.default, tier=HANDLER)
def _item(func, args, kwargs):
    return args[0]._to_cpu().item()


@register(aten._has_compatible_shallow_copy_type.default, tier=HANDLER)
def _shallow_copy_compatible(func, args, kwargs):
    """Autograd asks this when it replaces a tensor's data: a metadata question, no values needed."""
    return isinstance(args[0], LazyTensor) == isinstance(args[1], LazyTensor)


# ---- constant fills (see the module doc) ---------------------------------------------------
def _constant_data(shape, value, dtype):
    """The IR value of fresh device data of `shape` and `dtype` holding `value` everywhere."""
    shape = tuple(shape)
    metrics.counter_inc("DeviceDataTransfer")
    data = backend().full(shape, value, dtype)
    return (Node.leaf(data, ir.Meta(shape, dtype)), 0)


def _as_data(value) -> bool:
    """Whether a fill with `value` becomes data: a plain number, outside autograd's backward."""
    return type(value) in (int, float, bool) and torch._C._current_autograd_node() is None


@register(aten.zero_.default, aten.fill_.Scalar, tier=HANDLER)
def _fill_(func, args, kwargs):
    self = args[0]
    value = 0 if func is aten.zero_.default else args[1]
    if not self._chain and _as_data(value):  # the whole storage
        self._write(_constant_data(self.shape, value, self.dtype))
        return self
    full = functional(aten.full.default, (list(self.shape), value), {"dtype": self.dtype})
    self._write(full._value())  # through the view chain into the base
    return self


# op -> (fill value, or None: argument 1; where its size argument is, or None: the input's)
_FILLS = {
    aten.zeros_like.default: (0, None), aten.ones_like.default: (1, None), aten.full_like.default: (None, None),
    aten.new_zeros.default: (0, 1), aten.new_ones.default: (1, 1), aten.new_full.default: (None, 1),
}


@register(*_FILLS, tier=HANDLER)
def _fill_new(func, args, kwargs):
    value, size_at = _FILLS[func]
    self = args[0]
    if value is None:
        value = args[2] if size_at is not None else args[1]
    memory_format = kwargs.get("memory_format")
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "lazy":
        check_device(device)
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
        return functional(func, args, kwargs)
    shape = args[size_at] if size_at is not None else self.shape
    return LazyTensor.from_value(_constant_data(shape, value, kwargs.get("dtype") or self.dtype))


@register(aten.fill_.Tensor, tier=HANDLER)
def _fill_tensor_(func, args, kwargs):
    self, value = args[0], args[1]
    _copy_(aten.copy_.default, (self, value), {})
    return self


@register(aten.arange.out, aten.arange.start_out, tier=HANDLER)
def _arange_out(func, args, kwargs):
    """arange into a lazy `out` (what torch.arange(device='lazy') becomes): a factory, made on CPU."""
    out = kwargs["out"]
    new = LazyTensor.from_cpu(func(*args, out=torch.empty(0, dtype=out.dtype)), adopt=True)
    if tuple(new.shape) == tuple(out.shape):
        out._write(new._value())
    else:
        out._assume(new)
    return out
