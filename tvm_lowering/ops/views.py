"""View ops and their scatter inverses: t, transpose, squeeze, select, reshapes, as_strided, and
select/slice/diagonal/as_strided scatters.

A view's rule computes its value from the base's; a scatter writes a view's new value back into
the base (what an in-place write through a view records).
"""
import numpy as np
from tvm import relax, te, tirx

from .kit import arg, dtype, emit, emit_te, env, guarded, out_meta, shape
from .registry import rule


# ---- views ------------------------------------------------------------------------------------
@rule("t.default")
def t(imp, node):
    x = env(imp, node.args[0])
    if len(shape(x)) < 2:
        return x
    return emit(imp, relax.op.permute_dims(x, [1, 0]))


@rule("transpose.int")
def transpose(imp, node):
    """Negative dims wrap; a 0-dim tensor (dims 0 or -1) is its own transpose."""
    x = env(imp, node.args[0])
    nd = len(shape(x))
    if nd == 0:
        return x
    perm = list(range(nd))
    a, b = node.args[1] % nd, node.args[2] % nd
    perm[a], perm[b] = perm[b], perm[a]
    return emit(imp, relax.op.permute_dims(x, perm))


@rule("squeeze.dim", "squeeze.dims")
def squeeze(imp, node):
    """A reshape to the squeezed shape: also right for 0-dim inputs and dims whose size isn't 1
    (left in place), which TVM's squeeze rejects."""
    return emit(imp, relax.op.reshape(env(imp, node.args[0]), out_meta(node)[0]))


@rule("select.int")
def select(imp, node):
    """TVM's rule reads out of bounds for a negative index; normalise it first."""
    x = imp.env[node.args[0]]
    ndim = x.ty.ndim
    dim = node.args[1] % ndim
    size = int(x.ty.shape.values[dim])
    index = node.args[2] + size if node.args[2] < 0 else node.args[2]
    part = imp.block_builder.emit(relax.op.strided_slice(x, axes=[dim], begin=[index], end=[index + 1]))
    return imp.block_builder.emit(relax.op.squeeze(part, axis=[dim]))


@rule("_unsafe_view.default", "_reshape_alias.default")
def unsafe_view(imp, node):
    x = env(imp, node.args[0])
    want, _ = out_meta(node)
    return emit(imp, relax.op.reshape(x, want))


# ---- scatters into a view ---------------------------------------------------------------------
@rule("select_scatter.default")
def select_scatter(imp, node):
    x = env(imp, node.args[0])
    src = env(imp, node.args[1])
    xs = shape(x)
    dim = arg(node, 2, "dim") % len(xs)
    index = arg(node, 3, "index") % xs[dim]
    src = emit(imp, relax.op.expand_dims(src, dim))
    return emit_te(imp, _slice_scatter_te, x, src, index, 1, dim)


@rule("slice_scatter.default")
def slice_scatter(imp, node):
    """PyTorch semantics: start/end clamp to [0, size], negatives wrap, None means the end."""
    x = env(imp, node.args[0])
    src = env(imp, node.args[1])
    xs = shape(x)
    dim = arg(node, 2, "dim", 0) % len(xs)
    n = xs[dim]
    start = arg(node, 3, "start", None)
    end = arg(node, 4, "end", None)
    step = arg(node, 5, "step", 1)
    start = 0 if start is None else start
    end = n if end is None else end
    start = start + n if start < 0 else start
    end = end + n if end < 0 else end
    start = min(max(start, 0), n)
    end = min(max(end, start), n)
    if shape(src)[dim] == 0:
        return x
    return emit_te(imp, _slice_scatter_te, x, src, start, step, dim)


def _slice_scatter_te(x, src, start, step, dim):
    """x with src written at start, start + step, ... along dim (src's extent there says how many).

    TVM's own slice_scatter legalization crashed (a segfault copying a
    (1, 128, 8, 256) slice into (3, 128, 8, 256), the attention projection's
    gradient in nn.MultiheadAttention), so ratex computes it as a gather: every
    output element reads either x or the one src element that lands on it.
    """
    count = int(src.shape[dim])

    def body(*idx):
        offset = idx[dim] - start
        k = tirx.floordiv(offset, step)
        hit = tirx.all(offset >= 0, tirx.floormod(offset, step) == 0, k < count)
        src_idx = list(idx)
        src_idx[dim] = tirx.max(tirx.min(k, count - 1), 0)
        return guarded(hit, src[tuple(src_idx)], x[idx])

    return te.compute(x.shape, body, name="slice_scatter")


def _diag_scatter_te(x, src, offset, d1, d2):
    nd = len(x.shape)
    rest = [i for i in range(nd) if i not in (d1, d2)]

    def body(*idx):
        i1, i2 = idx[d1], idx[d2]
        k = i1 if offset >= 0 else i2
        on = i2 - i1 == offset
        src_idx = [idx[i] for i in rest] + [k]
        src_idx[-1] = tirx.max(tirx.min(k, src.shape[-1] - 1), 0)
        return guarded(on, src[tuple(src_idx)], x[idx])

    return te.compute(x.shape, body, name="diagonal_scatter")


@rule("diagonal_scatter.default")
def diagonal_scatter(imp, node):
    x = env(imp, node.args[0])
    src = env(imp, node.args[1])
    nd = len(shape(x))
    offset = arg(node, 2, "offset", 0)
    d1 = arg(node, 3, "dim1", 0) % nd
    d2 = arg(node, 4, "dim2", 1) % nd
    if shape(src)[-1] == 0:
        return x
    return emit_te(imp, _diag_scatter_te, x, src, offset, d1, d2)


# ---- as_strided -------------------------------------------------------------------------------
def _strided_positions(imp, size, stride, offset):
    """int64 tensor of `size` holding offset + sum(i_k * stride_k): flat positions of an as_strided view."""
    pos = relax.const(offset, "int64")
    for k, (n, st) in enumerate(zip(size, stride)):
        t = emit(imp, relax.op.arange(0, n, 1, "int64"))
        t = emit(imp, relax.op.reshape(t, [1] * k + [n] + [1] * (len(size) - k - 1)))
        pos = emit(imp, relax.op.add(pos, relax.op.multiply(t, relax.const(st, "int64"))))
    return emit(imp, relax.op.broadcast_to(pos, size))


def _strided_args(node, numel, first):
    size, stride = list(arg(node, first, "size")), list(arg(node, first + 1, "stride"))
    offset = arg(node, first + 2, "storage_offset", None) or 0
    last = offset + sum((n - 1) * st for n, st in zip(size, stride))
    if 0 not in size and (offset < 0 or last >= numel):
        raise NotImplementedError(f"as_strided reaching outside its input ({numel} elements)")
    return size, stride, offset


@rule("as_strided.default", "as_strided_copy.default")
def as_strided(imp, node):
    """Any sizes, strides and offset within the input, read from its contiguous value."""
    x = env(imp, node.args[0])
    numel = int(np.prod(shape(x)))
    size, stride, offset = _strided_args(node, numel, 1)
    if 0 in size:
        return emit(imp, relax.op.zeros(relax.ShapeExpr(size), dtype(x)))
    flat = emit(imp, relax.op.reshape(x, [numel]))
    pos = emit(imp, relax.op.reshape(_strided_positions(imp, size, stride, offset), [-1]))
    return emit(imp, relax.op.reshape(emit(imp, relax.op.take(flat, pos, axis=0)), size))


@rule("as_strided_scatter.default")
def as_strided_scatter(imp, node):
    x = env(imp, node.args[0])
    src = env(imp, node.args[1])
    xs = shape(x)
    numel = int(np.prod(xs))
    size, stride, offset = _strided_args(node, numel, 2)
    if 0 in size:
        return x
    flat = emit(imp, relax.op.reshape(x, [numel]))
    pos = emit(imp, relax.op.reshape(_strided_positions(imp, size, stride, offset), [-1]))
    vals = emit(imp, relax.op.reshape(src, [-1]))
    out = emit(imp, relax.op.scatter_elements(flat, pos, vals, axis=0, reduction="update"))
    return emit(imp, relax.op.reshape(out, xs))
