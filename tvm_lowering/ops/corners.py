"""Corners of common ops where TVM's rule raises or computes something else.

Found by the OpInfo conformance run: 0-dim inputs (which several TVM rules
index a dim of), zero-size reductions (a mean over no elements divides by a
constant 0 at compile time), dtype arguments TVM's rules ignore, integer
scalars and bounds next to tensors of another dtype, empty dims lists that
mean "every dim", and NaN where TVM's comparisons skip it.
"""
import math

from tvm import relax

from . import rule
from .arith import _NARROW  # dtypes whose arithmetic runs in int32
from .nn import arg, cast, dtype, emit, env, norm_dims, out_meta, shape


def _is_float(dt):
    return dt.startswith("float") or dt.startswith("bfloat")


def _axes(dims, nd):
    """Reduction axes of a `dim` argument: None (all) for None or an empty list, as PyTorch reads it."""
    if dims is None or (not isinstance(dims, int) and len(dims) == 0):
        return None
    return norm_dims(dims, nd)


def _full(imp, node, value):
    shp, dt = out_meta(node)
    return emit(imp, relax.op.broadcast_to(relax.const(value, dt), shp))


# ---- views ---------------------------------------------------------------------------------
@rule("squeeze.dim", "squeeze.dims")
def squeeze(imp, node):
    """A reshape to the squeezed shape: also right for 0-dim inputs and dims whose size isn't 1
    (left in place), which TVM's squeeze rejects."""
    return emit(imp, relax.op.reshape(env(imp, node.args[0]), out_meta(node)[0]))


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


@rule("pixel_shuffle.default")
def pixel_shuffle(imp, node):
    """(*, C*r*r, H, W) -> (*, C, H*r, W*r): split the channels, interleave, merge (TVM's op has no
    kernel)."""
    x = env(imp, node.args[0])
    r = arg(node, 1, "upscale_factor")
    *lead, c, h, w = shape(x)
    n = len(lead)
    split = emit(imp, relax.op.reshape(x, [*lead, c // (r * r), r, r, h, w]))
    perm = list(range(n)) + [n + i for i in (0, 3, 1, 4, 2)]
    moved = emit(imp, relax.op.permute_dims(split, perm))
    return emit(imp, relax.op.reshape(moved, out_meta(node)[0]))


# ---- creation with a dtype argument ---------------------------------------------------------
@rule("new_zeros.default", "zeros_like.default")
def zeros_of(imp, node):
    """In the dtype asked for (TVM's rules keep the input's)."""
    return _full(imp, node, 0)


@rule("new_ones.default", "ones_like.default")
def ones_of(imp, node):
    return _full(imp, node, 1)


@rule("new_full.default")
def new_full(imp, node):
    fill = arg(node, 2, "fill_value")
    _, dt = out_meta(node)
    if dt == "bool":
        fill = bool(fill)
    elif not _is_float(dt):
        fill = int(fill)
    return _full(imp, node, fill)


# ---- reductions ----------------------------------------------------------------------------
@rule("mean.dim")
def mean(imp, node):
    """A 0-dim input is its own mean; an empty dim list means every dim."""
    x = env(imp, node.args[0])
    _, dt = out_meta(node)
    x = cast(imp, x, dt)
    nd = len(shape(x))
    if nd == 0:
        return x
    axes = _axes(arg(node, 1, "dim"), nd)
    return emit(imp, relax.op.mean(x, axis=axes, keepdims=arg(node, 2, "keepdim", False)))


@rule("var.correction")
def var(imp, node):
    """sum((x - mean)^2) / max(0, N - correction), as PyTorch: NaN over no elements, and for
    N <= correction inf (or NaN where all deviations are 0). TVM's rule divides by N = 0 at
    compile time and returns NaN for every N <= correction."""
    x = env(imp, node.args[0])
    xs = shape(x)
    axes = _axes(arg(node, 1, "dim"), len(xs)) if xs else None
    n = math.prod(xs[a] for a in axes) if axes is not None else math.prod(xs)
    if n == 0:
        return _full(imp, node, math.nan)
    correction = node.kwargs.get("correction")
    correction = 1 if correction is None else correction
    keepdim = node.kwargs.get("keepdim", False)
    if not xs:
        x = emit(imp, relax.op.reshape(x, [1]))
        axes = None
    out = emit(imp, relax.op.variance(x, axis=axes, keepdims=keepdim))
    if not xs:
        out = emit(imp, relax.op.reshape(out, []))
    if correction == 0:
        return out
    scale = n / (n - correction) if n > correction else math.inf  # a variance of 0 times inf is NaN
    return emit(imp, relax.op.multiply(out, relax.const(scale, dtype(out))))


@rule("prod.default")
def prod(imp, node):
    """aten.prod (every dim) and prims.prod (the listed dims, from PyTorch's decomposition of
    prod.dim_int), in the output dtype; a 0-dim input is its own product."""
    x = env(imp, node.args[0])
    _, dt = out_meta(node)
    x = cast(imp, x, dt)
    nd = len(shape(x))
    if node.target.namespace == "prims":
        dims = list(node.args[1])
        if nd == 0 or not dims:
            return x
        return emit(imp, relax.op.prod(x, axis=norm_dims(dims, nd)))
    return x if nd == 0 else emit(imp, relax.op.prod(x))


@rule("any.dim", "any.dims")
def any_(imp, node):
    """Whether any element is non-zero, for every dtype (TVM's rule returns the max of a float
    tensor); a 0-dim input is tested as it is."""
    x = env(imp, node.args[0])
    nd = len(shape(x))
    nonzero = x if dtype(x) == "bool" else emit(imp, relax.op.not_equal(x, relax.const(0, dtype(x))))
    if nd == 0:
        return nonzero
    axes = _axes(arg(node, 1, "dim"), nd)
    hit = emit(imp, relax.op.max(cast(imp, nonzero, "int8"), axis=axes, keepdims=arg(node, 2, "keepdim", False)))
    return cast(imp, hit, "bool")


def first_extreme_index(imp, x, axis, keepdims, largest):
    """int64 index of the max (min) along `axis` (None: flattened): the first NaN where there is
    one, as in PyTorch (comparisons never pick a NaN, so TVM's argmax returned another index),
    else the first of equal extremes."""
    fn = relax.op.argmax if largest else relax.op.argmin
    idx = cast(imp, emit(imp, fn(x, axis=axis, keepdims=keepdims)), "int64")
    if not _is_float(dtype(x)):
        return idx
    nan = cast(imp, emit(imp, relax.op.isnan(x)), "int8")
    first_nan = cast(imp, emit(imp, relax.op.argmax(nan, axis=axis, keepdims=keepdims)), "int64")
    any_nan = cast(imp, emit(imp, relax.op.max(nan, axis=axis, keepdims=keepdims)), "bool")
    return emit(imp, relax.op.where(any_nan, first_nan, idx))


@rule("argmax.default", "argmin.default")
def arg_extreme(imp, node):
    """NaN-aware (see first_extreme_index); a 0-dim input's index is 0 (TVM's reduction rejects it)."""
    x = env(imp, node.args[0])
    shp, _ = out_meta(node)
    if not shape(x):
        return emit(imp, relax.op.zeros(relax.ShapeExpr(shp), "int64"))
    dim = arg(node, 1, "dim")
    axis = None if dim is None else dim % len(shape(x))
    largest = node.target.__name__.startswith("argmax")
    idx = first_extreme_index(imp, x, axis, arg(node, 2, "keepdim", False), largest)
    return idx if shape(idx) == shp else emit(imp, relax.op.reshape(idx, shp))


# ---- elementwise ops with Python scalars ------------------------------------------------------
@rule("rsub.Scalar")
def rsub(imp, node):
    """other - alpha * x in the output dtype (TVM's rule makes an int32 constant of an int scalar)."""
    _, dt = out_meta(node)
    compute = "int32" if dt in _NARROW else dt
    x = cast(imp, env(imp, node.args[0]), compute)
    alpha = arg(node, 2, "alpha", 1)
    if alpha != 1:
        x = emit(imp, relax.op.multiply(x, relax.const(alpha, compute)))
    return cast(imp, emit(imp, relax.op.subtract(relax.const(arg(node, 1, "other"), compute), x)), dt)


@rule("clamp.default")
def clamp(imp, node):
    """Bounds in the output dtype; an absent bound is no bound (TVM's rule passes +-inf, which an
    integer tensor can't hold); NaN inputs stay NaN."""
    _, dt = out_meta(node)
    x = cast(imp, env(imp, node.args[0]), dt)
    lo, hi = arg(node, 1, "min"), arg(node, 2, "max")
    if any(isinstance(b, float) and math.isnan(b) for b in (lo, hi)):
        return _full(imp, node, math.nan)  # a NaN bound makes every element NaN
    out = x
    if lo is not None:
        out = emit(imp, relax.op.maximum(out, relax.const(lo, dt)))
    if hi is not None:
        out = emit(imp, relax.op.minimum(out, relax.const(hi, dt)))
    if _is_float(dt):
        out = emit(imp, relax.op.where(relax.op.isnan(x), x, out))
    return out


# ---- indexing and joining ---------------------------------------------------------------------
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


@rule("addbmm.default")
def addbmm(imp, node):
    """beta * input + alpha * sum_b batch1[b] @ batch2[b], the batch sum done by one matmul:
    (n, B*m) @ (B*m, p). beta = 0 ignores input (NaN in it does not propagate), as PyTorch does."""
    inp, b1, b2 = (env(imp, a) for a in node.args[:3])
    beta, alpha = arg(node, 3, "beta", 1), arg(node, 4, "alpha", 1)
    shp, dt = out_meta(node)
    nb, n, m = shape(b1)
    p = shape(b2)[2]
    rows = emit(imp, relax.op.reshape(relax.op.permute_dims(b1, [1, 0, 2]), [n, nb * m]))
    cols = emit(imp, relax.op.reshape(b2, [nb * m, p]))
    out = emit(imp, relax.op.matmul(rows, cols))
    if alpha != 1:
        out = emit(imp, relax.op.multiply(out, relax.const(alpha, dt)))
    if beta == 0:
        return out
    scaled = inp if beta == 1 else emit(imp, relax.op.multiply(inp, relax.const(beta, dt)))
    return emit(imp, relax.op.add(out, relax.op.broadcast_to(scaled, shp)))
