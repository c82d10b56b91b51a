"""View ops, their scatter inverses, and simple tensor creation."""
from tvm import relax, te, tirx

from . import rule
from .indexing import scatter_into
from .nn import arg, emit, emit_te, env, out_meta, shape, zeros


@rule("t.default")
def t(imp, node):
    x = env(imp, node.args[0])
    if len(shape(x)) < 2:
        return x
    return emit(imp, relax.op.permute_dims(x, [1, 0]))


@rule("_unsafe_view.default", "_reshape_alias.default")
def unsafe_view(imp, node):
    x = env(imp, node.args[0])
    want, _ = out_meta(node)
    return emit(imp, relax.op.reshape(x, want))


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
        src_idx[dim] = tirx.max(tirx.min(k, count - 1), 0)  # clamped: the read stays in bounds
        return tirx.Select(hit, src[tuple(src_idx)], x[idx])

    return te.compute(x.shape, body, name="slice_scatter")


def _diag_scatter_te(x, src, offset, d1, d2):
    nd = len(x.shape)
    rest = [i for i in range(nd) if i not in (d1, d2)]

    def body(*idx):
        i1, i2 = idx[d1], idx[d2]
        k = i1 if offset >= 0 else i2
        on = i2 - i1 == offset
        src_idx = [idx[i] for i in rest] + [k]
        # Clamp the diagonal index so the (guarded) read stays in bounds.
        kmax = src.shape[-1] - 1
        src_idx[-1] = tirx.max(tirx.min(k, kmax), 0)
        return tirx.Select(on, src[tuple(src_idx)], x[idx])

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


@rule("zero.default")
def zero(imp, node):
    return emit(imp, relax.op.zeros_like(env(imp, node.args[0])))


@rule("new_empty.default", "empty_like.default", "new_empty_strided.default", "empty_strided.default")
def new_empty(imp, node):
    shp, dt = out_meta(node)
    return zeros(imp, shp, dt)


@rule("scatter_add.default")
def scatter_add(imp, node):
    x = env(imp, node.args[0])
    dim = arg(node, 1, "dim") % max(len(shape(x)), 1)
    index = env(imp, node.args[2])
    src = env(imp, node.args[3])
    ishape = shape(index)
    if 0 in ishape:
        return x
    if not shape(x):  # 0-dim: the one index names the one element; src's first element is added
        first = emit(imp, relax.op.strided_slice(emit(imp, relax.op.reshape(src, [-1])), [0], [0], [1]))
        return emit(imp, relax.op.add(x, relax.op.reshape(first, [])))
    # Not TVM's scatter_elements: it misplaces writes where index is narrower than x.
    return scatter_into(imp, x, dim, index, src, "sum")
