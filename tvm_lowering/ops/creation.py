"""Tensor creation: full, zeros/ones/full in their *_like and new_* forms, zero, empty tensors;
in the dtype asked for (TVM's rules keep the input's).

On the lazy device most creation is device data at once; these rules lower what is traced
(creation inside a backward, fills through a view).
"""
import torch
from tvm import relax

from .kit import arg, emit, env, filled, is_float, out_meta, zeros
from .registry import rule


@rule("full.default")
def full(imp, node):
    """The fill value broadcast to the shape. (TVM's rule fails to compile with an explicit
    dtype — its legalization takes the dtype attribute for a string — e.g. the -inf causal
    mask of nn.Transformer, and it cannot take a fill value that ratex lifted to an input.)"""
    fill = node.args[1]
    dtype = str(node.meta["val"].dtype).replace("torch.", "")
    shape = [int(s) for s in node.args[0]]
    if not isinstance(fill, torch.fx.Node):
        return imp.block_builder.emit(relax.op.broadcast_to(relax.const(fill, dtype), shape))
    value = imp.env[fill]
    if str(value.ty.dtype) != dtype:
        value = imp.block_builder.emit(relax.op.astype(value, dtype))
    return imp.block_builder.emit(relax.op.broadcast_to(value, shape))


@rule("new_zeros.default", "zeros_like.default")
def zeros_of(imp, node):
    """In the dtype asked for (TVM's rules keep the input's)."""
    return filled(imp, node, 0)


@rule("new_ones.default", "ones_like.default")
def ones_of(imp, node):
    return filled(imp, node, 1)


@rule("new_full.default")
def new_full(imp, node):
    fill = arg(node, 2, "fill_value")
    _, dt = out_meta(node)
    if dt == "bool":
        fill = bool(fill)
    elif not is_float(dt):
        fill = int(fill)
    return filled(imp, node, fill)


@rule("zero.default")
def zero(imp, node):
    return emit(imp, relax.op.zeros_like(env(imp, node.args[0])))


@rule("new_empty.default", "empty_like.default", "new_empty_strided.default", "empty_strided.default")
def new_empty(imp, node):
    shp, dt = out_meta(node)
    return zeros(imp, shp, dt)
