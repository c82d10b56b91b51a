"""Rules found missing or wrong by the OpInfo conformance run (scripts/conformance.py).

Each one is checked there against CPU PyTorch, on OpInfo's samples.
"""
import numpy as np
from tvm import relax

from . import rule
from .corners import first_extreme_index
from .indexing import scatter_into
from .nn import arg, cast, dtype, emit, env, out_meta, shape


# TVM's rule is plain bilinear resizing (no antialias filter): wrong whenever the image
# shrinks. None removes it, so the op runs on CPU PyTorch.
rule("_upsample_bilinear2d_aa.default")(None)


# ---- index_put -------------------------------------------------------------------------------
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


# ---- as_strided ---------------------------------------------------------------------------------
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


# ---- 0-dim inputs, which several of TVM's rules index out of range ----------------------------
@rule("_softmax.default", "_log_softmax.default")
def softmax(imp, node):
    """On a 0-dim tensor: a 1-element vector's softmax (TVM's rule assumes a dim to index)."""
    x = env(imp, node.args[0])
    if shape(x) or dtype(x) != out_meta(node)[1]:
        return imp.tvm_rules[node.target.__name__](node)
    fn = relax.op.nn.softmax if node.target.__name__.startswith("_softmax") else relax.op.nn.log_softmax
    out = emit(imp, fn(emit(imp, relax.op.reshape(x, [1])), axis=0))
    return emit(imp, relax.op.reshape(out, []))


@rule("cumsum.default", "cumprod.default")
def cumulative(imp, node):
    """In the output dtype from the start (bool and int inputs accumulate as int64); 0-dim is itself."""
    _, dt = out_meta(node)
    x = cast(imp, env(imp, node.args[0]), dt)
    nd = len(shape(x))
    if nd == 0:
        return x
    fn = relax.op.cumsum if node.target.__name__.startswith("cumsum") else relax.op.cumprod
    return emit(imp, fn(x, axis=arg(node, 1, "dim") % nd))


@rule("clamp.Tensor", "clamp_min.Tensor", "clamp_max.Tensor")
def clamp_tensor(imp, node):
    """Bounds of another dtype are promoted with the input first (TVM's rule mixes dtypes)."""
    x = env(imp, node.args[0])
    name = node.target.__name__
    _, dt = out_meta(node)
    lo = arg(node, 1, "min") if not name.startswith("clamp_max") else None
    hi = arg(node, 2, "max") if name.startswith("clamp.") else arg(node, 1, "max") if name.startswith("clamp_max") else None
    out = cast(imp, x, dt)
    if lo is not None:
        out = emit(imp, relax.op.maximum(out, cast(imp, env(imp, lo), dt)))
    if hi is not None:
        out = emit(imp, relax.op.minimum(out, cast(imp, env(imp, hi), dt)))
    return out


@rule("max.dim", "min.dim")
def max_dim(imp, node):
    """(values, indices) as arg-reduction then gather: TVM's topk rule fails at run time on bool,
    TVM has none for min.dim, and neither takes a 0-dim input."""
    x = env(imp, node.args[0])
    keepdim = arg(node, 2, "keepdim", False)
    nd = len(shape(x))
    if nd == 0:
        return emit(imp, relax.Tuple([x, relax.const(0, "int64")]))
    axis = arg(node, 1, "dim") % nd
    data = cast(imp, x, "int8") if dtype(x) == "bool" else x
    idx = first_extreme_index(imp, data, axis, True, largest=node.target.__name__.startswith("max"))
    values = emit(imp, relax.op.gather_elements(x, idx, axis=axis))
    if not keepdim:
        idx = emit(imp, relax.op.squeeze(idx, axis=[axis]))
        values = emit(imp, relax.op.squeeze(values, axis=[axis]))
    return emit(imp, relax.Tuple([values, idx]))


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


@rule("gather.default")
def gather(imp, node):
    """A 0-dim input has one element, which every index reads."""
    x = env(imp, node.args[0])
    if shape(x):
        return imp.tvm_rules["gather.default"](node)
    return emit(imp, relax.op.broadcast_to(x, shape(env(imp, node.args[2]))))


@rule("linalg_vector_norm.default")
def vector_norm(imp, node):
    """ord 0 counts non-zeros (TVM's rule divides by it); a 0-dim norm is |x| (TVM's sums over a
    dim it lacks); norms over every dim are computed here (TVM's rule reads an empty dim list as
    no dims); other cases are TVM's."""
    x = env(imp, node.args[0])
    nd = len(shape(x))
    order = float(arg(node, 1, "ord", 2))
    dims = arg(node, 2, "dim", None)
    every = dims is None or (not isinstance(dims, int) and len(dims) == 0)
    if order != 0 and nd and not every:
        return imp.tvm_rules["linalg_vector_norm.default"](node)
    _, dt = out_meta(node)
    if not nd:
        return cast(imp, emit(imp, relax.op.abs(x) if order else relax.op.not_equal(x, relax.const(0, dtype(x)))), dt)
    axes = None if every else [d % nd for d in ([dims] if isinstance(dims, int) else dims)]
    keepdim = arg(node, 3, "keepdim", False)
    if order == 0:
        nonzero = emit(imp, relax.op.astype(relax.op.not_equal(x, relax.const(0, dtype(x))), dt))
        return emit(imp, relax.op.sum(nonzero, axis=axes, keepdims=keepdim))
    a = emit(imp, relax.op.abs(cast(imp, x, dt)))
    if order in (np.inf, -np.inf):
        return emit(imp, (relax.op.max if order > 0 else relax.op.min)(a, axis=axes, keepdims=keepdim))
    if order == 1:
        return emit(imp, relax.op.sum(a, axis=axes, keepdims=keepdim))
    if order == 2:
        return emit(imp, relax.op.sqrt(relax.op.sum(relax.op.multiply(a, a), axis=axes, keepdims=keepdim)))
    p = relax.const(order, dt)
    total = emit(imp, relax.op.sum(relax.op.power(a, p), axis=axes, keepdims=keepdim))
    return emit(imp, relax.op.power(total, relax.const(1.0 / order, dt)))
