"""Indexing and joining: scatter in all its reductions, gather, index_select, index_put,
index_reduce, flat take/put, cat.

Scatters go through kit.scatter_into (see there why not TVM's scatter_elements). Negative
indices count from the end, as in PyTorch.
"""
import math

import numpy as np
from tvm import relax

from .kit import arg, cast, dtype, emit, env, flatten, out_meta, scatter_into, shape
from .registry import rule


# ---- scatter ----------------------------------------------------------------------------------
def _as_vector(imp, *values):
    """0-dim values as 1-element vectors (scatter along dim 0 of a 0-dim tensor means its one element)."""
    return [v if v is None or shape(v) else emit(imp, relax.op.reshape(v, [1])) for v in values]


def _reshaped_like(imp, out, x):
    return out if shape(out) == shape(x) else emit(imp, relax.op.reshape(out, shape(x)))


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
        return emit(imp, relax.op.reshape(cast(imp, src, dtype(x)), []))
    # Not TVM's scatter_elements: it misplaces writes where index is narrower than x.
    return scatter_into(imp, x, arg(node, 1, "dim") % len(xs), index, src, "update")


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


@rule("scatter_reduce.two")
def scatter_reduce(imp, node):
    x0 = env(imp, node.args[0])
    x, index, src = _as_vector(imp, x0, env(imp, node.args[2]), env(imp, node.args[3]))
    axis = arg(node, 1, "dim") % len(shape(x))
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
    out = scatter_into(imp, x, arg(node, 1, "dim") % len(shape(x)), index, src, reduce)
    return _reshaped_like(imp, out, x0)


@rule("index_reduce.default")
def index_reduce(imp, node):
    """A scatter whose index is the 1-D `index` laid along dim and repeated over source's other dims."""
    x0 = env(imp, node.args[0])
    x, index, src = _as_vector(imp, x0, env(imp, node.args[2]), env(imp, node.args[3]))
    axis = arg(node, 1, "dim") % len(shape(x))
    ss = shape(src)
    index = emit(imp, relax.op.reshape(index, [1] * axis + [-1] + [1] * (len(ss) - axis - 1)))
    index = emit(imp, relax.op.broadcast_to(index, ss))
    out = scatter_into(imp, x, axis, index, src, arg(node, 4, "reduce"), arg(node, 5, "include_self", True))
    return _reshaped_like(imp, out, x0)


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


@rule("index_put.default", "_unsafe_index_put.default")
def index_put(imp, node):
    """x[indices] = values (or += with accumulate) as one scatter over x's flat positions.

    TVM's rule mishandles full-slice (None) entries of `indices`; here every dim gets an
    int64 position tensor broadcast to the indexed shape, and they combine into flat offsets.
    """
    x = env(imp, node.args[0])
    values = env(imp, node.args[2])
    accumulate = arg(node, 3, "accumulate", False)
    xs = shape(x)
    nd = len(xs)
    idx = [env(imp, i) for i in node.args[1]] + [None] * (nd - len(node.args[1]))
    if nd == 0 or any(i is not None and dtype(i) in ("bool", "uint8") for i in idx):
        raise NotImplementedError("index_put with boolean masks or on a 0-dim tensor")
    rshape, bstart, bshape = _advanced_layout(xs, [None if i is None else shape(i) for i in idx])
    if 0 in rshape:
        return x
    slice_pos = iter([p for p in range(len(rshape)) if not bstart <= p < bstart + len(bshape)])
    strides = [int(np.prod(xs[d + 1:])) for d in range(nd)]
    flat = None
    for d in range(nd):
        if idx[d] is None:
            pos = next(slice_pos)
            t = emit(imp, relax.op.arange(0, xs[d], 1, "int64"))
            t = emit(imp, relax.op.reshape(t, [1] * pos + [xs[d]] + [1] * (len(rshape) - pos - 1)))
        else:
            t = cast(imp, idx[d], "int64")
            t = emit(imp, relax.op.where(relax.op.less(t, relax.const(0, "int64")),
                                         relax.op.add(t, relax.const(xs[d], "int64")), t))
            ishape = shape(idx[d])
            lead = [1] * (len(bshape) - len(ishape))
            t = emit(imp, relax.op.reshape(t, [1] * bstart + lead + ishape + [1] * (len(rshape) - bstart - len(bshape))))
        t = emit(imp, relax.op.multiply(t, relax.const(strides[d], "int64")))
        flat = t if flat is None else emit(imp, relax.op.add(flat, t))
    flat = emit(imp, relax.op.reshape(emit(imp, relax.op.broadcast_to(flat, rshape)), [-1]))
    vals = emit(imp, relax.op.broadcast_to(cast(imp, values, dtype(x)), rshape))
    vals = emit(imp, relax.op.reshape(vals, [-1]))
    data = emit(imp, relax.op.reshape(x, [-1]))
    out = emit(imp, relax.op.scatter_elements(data, flat, vals, axis=0, reduction="add" if accumulate else "update"))
    return emit(imp, relax.op.reshape(out, xs))


# ---- gather and select ------------------------------------------------------------------------
@rule("gather.default")
def gather(imp, node):
    """A 0-dim input has one element, which every index reads."""
    x = env(imp, node.args[0])
    if shape(x):
        return imp.tvm_rules["gather.default"](node)
    return emit(imp, relax.op.broadcast_to(x, shape(env(imp, node.args[2]))))


@rule("index_select.default")
def index_select(imp, node):
    """A 0-dim input has one element, which the (single, zero) index picks, and a 0-dim index
    keeps its dim (size 1); TVM's rule takes neither (index_reduce's gradient on a 0-dim tensor
    reaches it)."""
    x, index = env(imp, node.args[0]), env(imp, node.args[2])
    if not shape(x):
        return emit(imp, relax.op.broadcast_to(x, out_meta(node)[0]))
    if shape(index):
        return imp.tvm_rules["index_select.default"](node)
    index = emit(imp, relax.op.reshape(index, [1]))
    return emit(imp, relax.op.take(x, index, axis=node.args[1] % len(shape(x))))


# ---- flat take / put --------------------------------------------------------------------------
@rule("take.default")
def take(imp, node):
    """x's flattened elements at index (negatives count from the end), shaped like index."""
    x, index = env(imp, node.args[0]), env(imp, node.args[1])
    if math.prod(shape(x)) == 0:
        raise NotImplementedError("take from an empty tensor (every index is out of range)")
    # "wrap" reads an in-range negative index as PyTorch does, and keeps any other read in bounds.
    out = emit(imp, relax.op.take(flatten(imp, x), flatten(imp, cast(imp, index, "int64")), axis=0, mode="wrap"))
    return emit(imp, relax.op.reshape(out, shape(index)))


@rule("put.default")
def put(imp, node):
    """x with its flattened elements at index set to (or, accumulating, increased by) source's."""
    x = env(imp, node.args[0])
    index, src = env(imp, node.args[1]), env(imp, node.args[2])
    reduce = "sum" if arg(node, 3, "accumulate", False) else "update"
    out = scatter_into(imp, flatten(imp, x), 0, flatten(imp, index), flatten(imp, src), reduce)
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
