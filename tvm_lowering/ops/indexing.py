"""Indexing and joining: scatter in all its reductions, gather, embedding, index_select,
advanced indexing (index, index_put), index_reduce, flat take/put, cat.

Scatters go through kit.scatter_into (see there why not TVM's scatter_elements). Every index
read from a tensor goes through ops/bounds.py: it never reaches memory out of bounds, and one
that PyTorch refuses is reported. Negative indices count from the end where PyTorch lets them
(advanced indexing, take/put) and are refused where it does not (gather, scatter, embedding,
index_select, index_reduce).
"""
import math

import numpy as np
from tvm import relax

from . import bounds
from .kit import arg, cast, dtype, emit, env, flatten, out_meta, scatter_into, shape, zeros
from .registry import rule


# ---- scatter ----------------------------------------------------------------------------------
def _as_vector(imp, *values):
    """0-dim values as 1-element vectors (scatter along dim 0 of a 0-dim tensor means its one element)."""
    return [v if v is None or shape(v) else emit(imp, relax.op.reshape(v, [1])) for v in values]


def _reshaped_like(imp, out, x):
    return out if shape(out) == shape(x) else emit(imp, relax.op.reshape(out, shape(x)))


def _scatter_index(imp, index, size, axis):
    """`index` of a scatter along `axis` (of `size`), checked: the CPU's host loops skip an index
    out of range by themselves; TVM's scatter_elements, elsewhere, writes where it points."""
    return bounds.index(imp, index, size, axis, clamp=not imp.host_kernels)


@rule("scatter.src", "scatter.value")
def scatter(imp, node):
    """scatter_elements on the index-shaped corner of src (or a filled tensor); 0-dim works too."""
    x = env(imp, node.args[0])
    index = env(imp, node.args[2])
    xs, ishape = shape(x), shape(index)
    if 0 in ishape:
        return x
    if node.target.__name__ == "scatter.value":
        src = emit(imp, relax.op.full(relax.ShapeExpr(ishape), relax.const(arg(node, 3, "value"), dtype(x)), dtype(x)))
    else:
        src = env(imp, node.args[3])
        if shape(src) != ishape:  # PyTorch reads only the index-shaped corner of src
            src = emit(imp, relax.op.strided_slice(src, list(range(len(ishape))), [0] * len(ishape), ishape))
    if not xs:  # a 0-dim tensor: the only position is written
        bounds.record(imp, index, 1)
        return emit(imp, relax.op.reshape(cast(imp, src, dtype(x)), []))
    axis = arg(node, 1, "dim") % len(xs)
    # Not TVM's scatter_elements: it misplaces writes where index is narrower than x.
    return scatter_into(imp, x, axis, _scatter_index(imp, index, xs[axis], axis), src, "update")


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
        bounds.record(imp, index, 1)
        first = emit(imp, relax.op.strided_slice(emit(imp, relax.op.reshape(src, [-1])), [0], [0], [1]))
        return emit(imp, relax.op.add(x, relax.op.reshape(first, [])))
    # Not TVM's scatter_elements: it misplaces writes where index is narrower than x.
    return scatter_into(imp, x, dim, _scatter_index(imp, index, shape(x)[dim], dim), src, "sum")


@rule("scatter_reduce.two")
def scatter_reduce(imp, node):
    x0 = env(imp, node.args[0])
    x, index, src = _as_vector(imp, x0, env(imp, node.args[2]), env(imp, node.args[3]))
    axis = arg(node, 1, "dim") % len(shape(x))
    index = _scatter_index(imp, index, shape(x)[axis], axis)
    out = scatter_into(imp, x, axis, index, src, arg(node, 4, "reduce"), arg(node, 5, "include_self", True))
    return _reshaped_like(imp, out, x0)


@rule("scatter.reduce", "scatter.value_reduce")
def scatter_with_reduce(imp, node):
    """The older scatter(..., reduce='add' | 'multiply'): include_self always."""
    x0 = env(imp, node.args[0])
    x, index = _as_vector(imp, x0, env(imp, node.args[2]))
    if node.target.__name__ == "scatter.value_reduce":
        src = emit(imp, relax.op.full(relax.ShapeExpr(shape(index)), relax.const(node.args[3], dtype(x)), dtype(x)))
    else:
        (src,) = _as_vector(imp, env(imp, node.args[3]))
    reduce = {"add": "sum", "multiply": "prod"}[arg(node, 4, "reduce")]
    axis = arg(node, 1, "dim") % len(shape(x))
    out = scatter_into(imp, x, axis, _scatter_index(imp, index, shape(x)[axis], axis), src, reduce)
    return _reshaped_like(imp, out, x0)


def _index_scatter(imp, node, reduce, include_self=True, alpha=1):
    """x with source scattered in along dim at the 1-D `index`, laid along dim and repeated over
    source's other dims (index_add/index_copy/index_reduce). Their negative indices are refused,
    as PyTorch refuses them (torch._decomp's index_put would count them from the end)."""
    x0 = env(imp, node.args[0])
    x, index, src = _as_vector(imp, x0, env(imp, node.args[2]), env(imp, node.args[3]))
    axis = arg(node, 1, "dim") % len(shape(x))
    ss = shape(src)
    index = _scatter_index(imp, index, shape(x)[axis], axis)
    index = emit(imp, relax.op.reshape(index, [1] * axis + [-1] + [1] * (len(ss) - axis - 1)))
    index = emit(imp, relax.op.broadcast_to(index, ss))
    if alpha != 1:
        src = emit(imp, relax.op.multiply(cast(imp, src, dtype(x)), relax.const(alpha, dtype(x))))
    out = scatter_into(imp, x, axis, index, src, reduce, include_self)
    return _reshaped_like(imp, out, x0)


@rule("index_reduce.default")
def index_reduce(imp, node):
    """x.index_reduce_(dim, index, source, reduce), functional."""
    return _index_scatter(imp, node, arg(node, 4, "reduce"), arg(node, 5, "include_self", True))


@rule("index_add.default")
def index_add(imp, node):
    """x.index_add(dim, index, source, alpha=alpha)."""
    return _index_scatter(imp, node, "sum", alpha=arg(node, 4, "alpha", 1))


@rule("index_copy.default")
def index_copy(imp, node):
    """x.index_copy(dim, index, source)."""
    return _index_scatter(imp, node, "update")


# ---- index_put --------------------------------------------------------------------------------
def _advanced_layout(xs, idx_shapes):
    """Shape of `x[indices]` and where the broadcast index dims start, per PyTorch's rules.

    `idx_shapes[d]` is the shape of the index tensor of dim d, None for a full slice.
    Adjacent index tensors put their broadcast dims where they stand; separated ones
    put them first.
    """
    adv = [d for d, s in enumerate(idx_shapes) if s is not None]
    bshape = list(np.broadcast_shapes(*[tuple(idx_shapes[d]) for d in adv]))
    if adv == list(range(adv[0], adv[-1] + 1)):
        start = adv[0]
        return xs[:start] + bshape + xs[adv[-1] + 1:], start, bshape
    return bshape + [xs[d] for d, s in enumerate(idx_shapes) if s is None], 0, bshape


def _flat_positions(imp, x, indices):
    """(flat positions in x of `x[indices]`, the result's shape), None where it has no elements.

    `indices` holds an index tensor or None (a full slice) per leading dim of x. Every dim
    gets an int64 position tensor broadcast to the indexed shape, and they add up to offsets
    into the flattened x. Negative indices count from the end; each index tensor is checked
    and clamped (bounds.index), so every offset lies inside x.
    """
    xs = shape(x)
    nd = len(xs)
    idx = list(indices) + [None] * (nd - len(indices))
    if nd == 0 or any(i is not None and dtype(i) in ("bool", "uint8") for i in idx):
        raise NotImplementedError("advanced indexing with boolean masks or of a 0-dim tensor")
    rshape, bstart, bshape = _advanced_layout(xs, [None if i is None else shape(i) for i in idx])
    if 0 in rshape:
        return None
    slice_pos = iter([p for p in range(len(rshape)) if not bstart <= p < bstart + len(bshape)])
    strides = [int(np.prod(xs[d + 1:])) for d in range(nd)]
    flat = None
    for d in range(nd):
        if idx[d] is None:
            pos = next(slice_pos)
            t = emit(imp, relax.op.arange(0, xs[d], 1, "int64"))
            t = emit(imp, relax.op.reshape(t, [1] * pos + [xs[d]] + [1] * (len(rshape) - pos - 1)))
        else:
            t = bounds.index(imp, idx[d], xs[d], d, wrap=True)
            ishape = shape(idx[d])
            lead = [1] * (len(bshape) - len(ishape))
            t = emit(imp, relax.op.reshape(t, [1] * bstart + lead + ishape + [1] * (len(rshape) - bstart - len(bshape))))
        t = emit(imp, relax.op.multiply(t, relax.const(strides[d], "int64")))
        flat = t if flat is None else emit(imp, relax.op.add(flat, t))
    return emit(imp, relax.op.reshape(emit(imp, relax.op.broadcast_to(flat, rshape)), [-1])), rshape


@rule("index_put.default", "_unsafe_index_put.default")
def index_put(imp, node):
    """x[indices] = values (or += with accumulate) as one scatter over x's flat positions.

    TVM's rule mishandles full-slice (None) entries of `indices` (see _flat_positions).
    """
    x = env(imp, node.args[0])
    values = env(imp, node.args[2])
    accumulate = arg(node, 3, "accumulate", False)
    positions = _flat_positions(imp, x, [env(imp, i) for i in node.args[1]])
    if positions is None:
        return x
    flat, rshape = positions
    vals = emit(imp, relax.op.broadcast_to(cast(imp, values, dtype(x)), rshape))
    vals = emit(imp, relax.op.reshape(vals, [-1]))
    data = emit(imp, relax.op.reshape(x, [-1]))
    out = emit(imp, relax.op.scatter_elements(data, flat, vals, axis=0, reduction="add" if accumulate else "update"))
    return emit(imp, relax.op.reshape(out, shape(x)))


@rule("index.Tensor")
def index(imp, node):
    """x[indices]: one index tensor is a take along its dim; several, a take at x's flat positions.

    TVM's rule reads out of bounds for a negative index (PyTorch counts it from the end).
    """
    x = env(imp, node.args[0])
    idx = [env(imp, i) for i in node.args[1]]
    given = [d for d, i in enumerate(idx) if i is not None]
    if len(given) == 1 and dtype(idx[given[0]]) not in ("bool", "uint8"):
        return bounds.take(imp, x, idx[given[0]], given[0], wrap=True)
    positions = _flat_positions(imp, x, idx)
    if positions is None:
        return zeros(imp, *out_meta(node))
    flat, rshape = positions
    return emit(imp, relax.op.reshape(relax.op.take(flatten(imp, x), flat, axis=0, mode="clip"), rshape))


# ---- gather and select ------------------------------------------------------------------------
@rule("gather.default")
def gather(imp, node):
    """gather_elements on checked indices; a 0-dim input has one element, which every index reads."""
    x, index = env(imp, node.args[0]), env(imp, node.args[2])
    xs = shape(x)
    if not xs:
        bounds.record(imp, index, 1)
        return emit(imp, relax.op.broadcast_to(x, shape(index)))
    axis = arg(node, 1, "dim") % len(xs)
    return emit(imp, relax.op.gather_elements(x, bounds.index(imp, index, xs[axis], axis), axis=axis))


@rule("index_select.default")
def index_select(imp, node):
    """A take along dim. A 0-dim input has one element, which the (single, zero) index picks, and
    a 0-dim index keeps its dim (size 1); TVM's rule takes neither (index_reduce's gradient on a
    0-dim tensor reaches it)."""
    x, index = env(imp, node.args[0]), env(imp, node.args[2])
    if not shape(x):
        bounds.record(imp, index, 1)
        return emit(imp, relax.op.broadcast_to(x, out_meta(node)[0]))
    if not shape(index):
        index = emit(imp, relax.op.reshape(index, [1]))
    return bounds.take(imp, x, index, node.args[1] % len(shape(x)))


@rule("embedding.default")
def embedding(imp, node):
    """weight's rows at the indices, shaped like them plus a dim of the row size. TVM's rule
    casts int64 indices to int32 first, which makes 2^32 + 1 read row 1."""
    weight, index = env(imp, node.args[0]), env(imp, node.args[1])
    flat = index if len(shape(index)) == 1 else flatten(imp, index)
    rows = bounds.take(imp, weight, flat, 0)
    return emit(imp, relax.op.reshape(rows, shape(index) + shape(weight)[1:]))


# ---- flat take / put --------------------------------------------------------------------------
@rule("take.default")
def take(imp, node):
    """x's flattened elements at index (negatives count from the end), shaped like index."""
    x, index = env(imp, node.args[0]), env(imp, node.args[1])
    if math.prod(shape(x)) == 0:
        raise NotImplementedError("take from an empty tensor (every index is out of range)")
    out = bounds.take(imp, flatten(imp, x), flatten(imp, index), 0, wrap=True, dim=-1)
    return emit(imp, relax.op.reshape(out, shape(index)))


@rule("put.default")
def put(imp, node):
    """x with its flattened elements at index set to (or, accumulating, increased by) source's;
    negative indices count from the end."""
    x = env(imp, node.args[0])
    index, src = env(imp, node.args[1]), env(imp, node.args[2])
    reduce = "sum" if arg(node, 3, "accumulate", False) else "update"
    index = bounds.index(imp, flatten(imp, index), math.prod(shape(x)), -1, wrap=True, clamp=not imp.host_kernels)
    out = scatter_into(imp, flatten(imp, x), 0, index, flatten(imp, src), reduce)
    return emit(imp, relax.op.reshape(out, shape(x)))


# ---- joining ----------------------------------------------------------------------------------
@rule("cat.default")
def cat(imp, node):
    """Inputs without elements add nothing and may be 1-D (0,) whatever the others' rank, as
    PyTorch allows: they are dropped; the rest join in the promoted dtype."""
    shp, dt = out_meta(node)
    parts = [cast(imp, env(imp, t), dt) for t in node.args[0]]
    parts = [p for p in parts if 0 not in shape(p)]
    if not parts:
        return emit(imp, relax.op.zeros(relax.ShapeExpr(shp), dt))
    if len(parts) == 1:
        return parts[0]
    axis = arg(node, 1, "dim", 0) % len(shp)
    return emit(imp, relax.op.concat(parts, axis=axis))
