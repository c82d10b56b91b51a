"""Reductions and scans: sum, mean, var/std, prod, any, max/min and their arg forms, vector norms,
cumulative sums, products, extremes and log-sum-exp.

As PyTorch reduces: 0-dim inputs, empty dim lists (every dim), no elements, slices of only
-inf, NaN (which a max or argmax picks) and ties, where TVM's rules raise or compute something
else. The running extremes and logcumsumexp are serial TIR loops run on the host, in CPU
builds only (see kit.emit_host_kernel).
"""
import math

import numpy as np
from tvm import relax, te, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from .kit import (accumulation, arg, cast, dtype, emit, emit_host_kernel, emit_te, env, filled, is_float, isnan, nan_mask, norm_dims,
                  out_meta, shape, to_dtype)
from .registry import rule


# ---- sums, means, variances, products ---------------------------------------------------------
# PyTorch's CPU kernels sum, average and take norms and variances of float16/bfloat16 tensors in
# float32 and round the result once; TVM's reductions accumulate in the tensor's dtype (a bfloat16
# row sum of 96 elements came out 100% off). These accumulate in float32 too.
_HALF = ("float16", "bfloat16")


@rule("sum.dim_IntList", "sum.default")
def sum_dim(imp, node):
    x = env(imp, node.args[0])
    _, dt = out_meta(node)
    nd = len(shape(x))
    if nd == 0:  # summing a 0-dim tensor over dim 0 (or []) returns it unchanged
        return cast(imp, x, dt)
    if dt not in _HALF:
        return imp.tvm_rules[node.target.__name__](node)
    dims = arg(node, 1, "dim") if node.target.__name__ == "sum.dim_IntList" else None
    total = relax.op.sum(cast(imp, x, "float32"), axis=_axes(dims, nd), keepdims=arg(node, 2, "keepdim", False))
    return to_dtype(imp, emit(imp, total), dt)


def _axes(dims, nd):
    """Reduction axes of a `dim` argument: None (all) for None or an empty list, as PyTorch reads it."""
    if dims is None or (not isinstance(dims, int) and len(dims) == 0):
        return None
    return norm_dims(dims, nd)


@rule("mean.dim", "mean.default")
def mean(imp, node):
    """A 0-dim input is its own mean; an empty dim list means every dim."""
    x = env(imp, node.args[0])
    _, dt = out_meta(node)
    x = cast(imp, x, accumulation(dt))
    nd = len(shape(x))
    if nd == 0:
        return to_dtype(imp, x, dt)
    axes = _axes(arg(node, 1, "dim"), nd)
    return to_dtype(imp, emit(imp, relax.op.mean(x, axis=axes, keepdims=arg(node, 2, "keepdim", False))), dt)


def _variance(imp, node):
    """sum((x - mean)^2) / max(0, N - correction), as PyTorch: NaN over no elements, and for
    N <= correction inf (or NaN where all deviations are 0). TVM's rule divides by N = 0 at
    compile time and returns NaN for every N <= correction. In float32 for a half-precision x."""
    _, dt = out_meta(node)
    x = cast(imp, env(imp, node.args[0]), accumulation(dt))
    xs = shape(x)
    axes = _axes(arg(node, 1, "dim"), len(xs)) if xs else None
    n = math.prod(xs[a] for a in axes) if axes is not None else math.prod(xs)
    if n == 0:
        return filled(imp, node, math.nan)
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


@rule("var.correction")
def var(imp, node):
    return to_dtype(imp, _variance(imp, node), out_meta(node)[1])


@rule("std.correction")
def std(imp, node):
    """sqrt of the variance (TVM's std ignores `correction`), rounded once."""
    return to_dtype(imp, emit(imp, relax.op.sqrt(_variance(imp, node))), out_meta(node)[1])


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


# ---- max and min, and where they are ----------------------------------------------------------
def extreme(imp, x, axes, keepdims, largest):
    """max (or min) over `axes`, -inf (+inf) where every element is -inf (+inf), NaN where one is.

    TVM's max reduction starts from the lowest finite value, so a slice of only -inf
    (a fully masked attention row) came out as -3.4e38 instead of -inf; its comparisons skip
    a NaN, which PyTorch's max returns.
    """
    reduce = relax.op.max if largest else relax.op.min
    out = emit(imp, reduce(x, axis=axes, keepdims=keepdims))
    dt = dtype(x)
    if not is_float(dt):
        return out
    inf = relax.const(-np.inf if largest else np.inf, dt)
    hit = emit(imp, relax.op.astype(relax.op.equal(x, inf), "int8"))
    every = emit(imp, relax.op.equal(relax.op.min(hit, axis=axes, keepdims=keepdims), relax.const(1, "int8")))
    out = emit(imp, relax.op.where(every, inf, out))
    nan = emit(imp, relax.op.max(cast(imp, nan_mask(imp, x), "int8"), axis=axes, keepdims=keepdims))
    return emit(imp, relax.op.where(cast(imp, nan, "bool"), relax.const(np.nan, dt), out))


@rule("amax.default", "amin.default", "max.default", "min.default")
def amax(imp, node):
    """Bool tensors reduce as int32 (TVM has no max/min identity for bool): amax is any, amin is all."""
    x = env(imp, node.args[0])
    name = node.target.__name__
    dims = arg(node, 1, "dim", []) if name.startswith("am") else []
    keepdim = arg(node, 2, "keepdim", False) if name.startswith("am") else False
    nd = len(shape(x))
    axes = norm_dims(dims, nd) if dims not in ([], ()) else None
    if nd == 0:
        return x
    largest = name.startswith(("amax", "max"))
    if dtype(x) == "bool":
        reduce = relax.op.max if largest else relax.op.min
        return cast(imp, emit(imp, reduce(cast(imp, x, "int32"), axis=axes, keepdims=keepdim)), "bool")
    return extreme(imp, x, axes, keepdim, largest=largest)


def first_extreme_index(imp, x, axis, keepdims, largest):
    """int64 index of the max (min) along `axis` (None: flattened): the first NaN where there is
    one, as in PyTorch (comparisons never pick a NaN, so TVM's argmax returned another index),
    else the first of equal extremes."""
    fn = relax.op.argmax if largest else relax.op.argmin
    if dtype(x) == "bfloat16":  # TVM's isnan takes no bfloat16; widening is exact
        x = cast(imp, x, "float32")
    idx = cast(imp, emit(imp, fn(x, axis=axis, keepdims=keepdims)), "int64")
    if not is_float(dtype(x)):
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


# ---- vector norms -----------------------------------------------------------------------------
@rule("linalg_vector_norm.default")
def vector_norm(imp, node):
    """ord 0 counts non-zeros (TVM's rule divides by it); a 0-dim norm is |x| (TVM's sums over a
    dim it lacks); norms over every dim are computed here (TVM's rule reads an empty dim list as
    no dims), and every half-precision norm (in float32) and max or min norm (NaN where the slice
    holds one: TVM's max drops it); other cases are TVM's."""
    x = env(imp, node.args[0])
    nd = len(shape(x))
    order = float(arg(node, 1, "ord", 2))
    dims = arg(node, 2, "dim", None)
    every = dims is None or (not isinstance(dims, int) and len(dims) == 0)
    if order not in (0, np.inf, -np.inf) and nd and not every and out_meta(node)[1] not in _HALF:
        return imp.tvm_rules["linalg_vector_norm.default"](node)
    _, dt = out_meta(node)
    if not nd:
        return cast(imp, emit(imp, relax.op.abs(x) if order else relax.op.not_equal(x, relax.const(0, dtype(x)))), dt)
    axes = None if every else [d % nd for d in ([dims] if isinstance(dims, int) else dims)]
    return to_dtype(imp, _norm(imp, x, order, axes, arg(node, 3, "keepdim", False), accumulation(dt)), dt)


def _norm(imp, x, order, axes, keepdim, dt):
    """The `order`-norm of x over `axes`, computed in `dt`."""
    if order == 0:
        nonzero = emit(imp, relax.op.astype(relax.op.not_equal(x, relax.const(0, dtype(x))), dt))
        return emit(imp, relax.op.sum(nonzero, axis=axes, keepdims=keepdim))
    a = emit(imp, relax.op.abs(cast(imp, x, dt)))
    if order in (np.inf, -np.inf):
        return extreme(imp, a, axes, keepdim, largest=order > 0)
    if order == 1:
        return emit(imp, relax.op.sum(a, axis=axes, keepdims=keepdim))
    if order == 2:
        return emit(imp, relax.op.sqrt(relax.op.sum(relax.op.multiply(a, a), axis=axes, keepdims=keepdim)))
    p = relax.const(order, dt)
    total = emit(imp, relax.op.sum(relax.op.power(a, p), axis=axes, keepdims=keepdim))
    return emit(imp, relax.op.power(total, relax.const(1.0 / order, dt)))


# ---- scans ------------------------------------------------------------------------------------
@rule("cumsum.default", "cumprod.default")
def cumulative(imp, node):
    """In the output dtype from the start (bool and int inputs accumulate as int64); 0-dim is itself."""
    _, dt = out_meta(node)
    x = cast(imp, env(imp, node.args[0]), accumulation(dt))  # half precision: a float32 running total, each output rounded
    nd = len(shape(x))
    if nd == 0:
        return to_dtype(imp, x, dt)
    fn = relax.op.cumsum if node.target.__name__.startswith("cumsum") else relax.op.cumprod
    return to_dtype(imp, emit(imp, fn(x, axis=arg(node, 1, "dim") % nd)), dt)


def _scan_te(x, step, out_dtypes, name):
    """A serial scan along the middle dim of x (B, D, A): one parallel task per (b, a).

    `step(x_k, k, prev)` gives the outputs at position k from x's element there and the
    outputs at k - 1 (None at k = 0).
    """
    B, D, A = (int(s) for s in x.shape)

    def gen(ins, outs):
        data = T.buffer_proxy(ins[0])
        res = [T.buffer_proxy(o) for o in outs]
        with IRBuilder() as ib:
            with T.parallel(0, B * A) as col:
                b, a = tirx.floordiv(col, A), tirx.floormod(col, A)
                for r, v in zip(res, step(data[b, 0, a], tirx.const(0, "int64"), None)):
                    r[b, 0, a] = v
                with T.serial(1, D) as k:
                    prev = [r[b, k - 1, a] for r in res]
                    for r, v in zip(res, step(data[b, k, a], k.astype("int64"), prev)):
                        r[b, k, a] = v
            return ib.get()

    return te.extern([x.shape] * len(out_dtypes), [x], gen, dtype=list(out_dtypes), name=name)


def _along(imp, node, x):
    """x as (before, dim, after) around the scanned dim, or None for a 0-dim x."""
    xs = shape(x)
    if not xs:
        return None
    d = arg(node, 1, "dim") % len(xs)
    return emit(imp, relax.op.reshape(x, [math.prod(xs[:d]), xs[d], math.prod(xs[d + 1:])]))


@rule("cummax.default", "cummin.default")
def cumulative_extreme(imp, node):
    """(values, indices): a value at least as large (small) as the running one, or a NaN, takes over,
    so ties report the last position, as PyTorch does."""
    x = env(imp, node.args[0])
    largest = node.target.__name__.startswith("cummax")
    dt = dtype(x)
    xs = shape(x)
    data = _along(imp, node, x)
    if data is None:
        return emit(imp, relax.Tuple([x, relax.const(0, "int64")]))
    if not is_float(dt) and dt not in ("int32", "int64"):
        data = cast(imp, data, "int32")  # LLVM rejects comparisons of bool and narrow integers

    def step(v, k, prev):
        if prev is None:
            return v, k
        best, where = prev
        take = v >= best if largest else v <= best
        if is_float(dt):
            take = tirx.any(isnan(v), take)
        return tirx.Select(take, v, best), tirx.Select(take, k, where)

    name = "cummax" if largest else "cummin"
    out = emit_host_kernel(imp, name, lambda t: _scan_te(t, step, (dtype(data), "int64"), name), data)
    values = cast(imp, emit(imp, relax.TupleGetItem(out, 0)), dt)
    indices = emit(imp, relax.TupleGetItem(out, 1))
    return emit(imp, relax.Tuple([emit(imp, relax.op.reshape(t, xs)) for t in (values, indices)]))


def _log_add_exp(a, b):
    """log(exp(a) + exp(b)) in float64; equal infinities stay themselves (not inf - inf = NaN)."""
    hi, lo = tirx.max(a, b), tirx.min(a, b)
    summed = hi + tirx.log1p(tirx.exp(lo - hi))
    nan = tirx.any(tirx.isnan(a), tirx.isnan(b))
    return tirx.Select(nan, a + b, tirx.Select(tirx.all(hi == lo, tirx.isinf(hi)), hi, summed))


@rule("logcumsumexp.default")
def logcumsumexp(imp, node):
    """Running log-sum-exp, accumulated in float64 so a long scan does not drift."""
    x = env(imp, node.args[0])
    dt = dtype(x)
    data = _along(imp, node, x)
    if data is None:
        return x
    if not is_float(dt):
        raise NotImplementedError(f"logcumsumexp of {dt}")
    data = cast(imp, data, "float64")

    def step(v, k, prev):
        return (v,) if prev is None else (_log_add_exp(prev[0], v),)

    # One output: the extern returns a tensor, not a tuple.
    out = emit_host_kernel(imp, "logcumsumexp", lambda t: _scan_te(t, step, ("float64",), "logcumsumexp"), data)
    return cast(imp, emit(imp, relax.op.reshape(out, shape(x))), dt)


# ---- sorting ----------------------------------------------------------------------------------
# TVM sorts with comparisons, which NaN breaks (a NaN stayed where it was and took its
# neighbours' order with it), and its CPU sort kernel has no bfloat16 (the values came out
# unsorted). PyTorch sorts NaN above +inf and -0.0 equal to 0.0. These rules sort an integer
# key that orders as PyTorch does and gather the values at the indices found: TVM sorts
# integers right, stably on the CPU (equal keys keep their order, ascending or descending, as
# PyTorch's stable sort does).
_KEY_BITS = {"float32": "int32", "float64": "int64"}


def _sort_key_te(x):
    """x's elements as signed integers in PyTorch's sort order: the float's bits, with the
    magnitude bits of negatives flipped; -0.0 as 0.0; every NaN as the largest integer."""
    dt = str(x.dtype)
    bits = _KEY_BITS[dt]
    top = tirx.const((1 << (int(bits[3:]) - 1)) - 1, bits)

    def key(v):
        raw = tirx.reinterpret(bits, v)
        k = tirx.Select(raw < tirx.const(0, bits), tirx.bitwise_xor(raw, top), raw)
        k = tirx.Select(v == tirx.const(0, dt), tirx.const(0, bits), k)
        return tirx.Select(tirx.isnan(v), top, k)

    return te.compute(x.shape, lambda *i: key(x(*i)), name="sort_key")


def sort_key(imp, x):
    """An integer tensor of x's shape that sorts as PyTorch sorts x (see _sort_key_te)."""
    dt = dtype(x)
    if not is_float(dt):
        return x if dt in ("int32", "int64") else cast(imp, x, "int32")
    return emit_te(imp, _sort_key_te, cast(imp, x, "float64" if dt == "float64" else "float32"))


def _sorted_indices(imp, x, axis, descending):
    """int64 indices that sort x along `axis` as PyTorch's stable sort does."""
    return emit(imp, relax.op.argsort(sort_key(imp, x), axis=axis, descending=descending, dtype="int64"))


def _sort_args(imp, node):
    """(x, dim, descending) of sort/argsort: the `.stable` overloads take dim and descending by keyword only."""
    if node.target.__name__.endswith(".stable"):
        return env(imp, node.args[0]), node.kwargs.get("dim", -1), node.kwargs.get("descending", False)
    return env(imp, node.args[0]), arg(node, 1, "dim", -1), arg(node, 2, "descending", False)


@rule("sort.default", "sort.stable")
def sort(imp, node):
    """(values, indices): NaN last ascending and first descending, equal values in their order."""
    x, dim, descending = _sort_args(imp, node)
    if not shape(x):
        return emit(imp, relax.Tuple([x, relax.const(0, "int64")]))
    axis = dim % len(shape(x))
    idx = _sorted_indices(imp, x, axis, bool(descending))
    return emit(imp, relax.Tuple([emit(imp, relax.op.gather_elements(x, idx, axis=axis)), idx]))


@rule("argsort.default", "argsort.stable")
def argsort(imp, node):
    """The indices of sort (a jit.script trace records argsort whole)."""
    x, dim, descending = _sort_args(imp, node)
    if not shape(x):
        return relax.const(0, "int64")
    return _sorted_indices(imp, x, dim % len(shape(x)), bool(descending))


@rule("topk.default")
def topk(imp, node):
    """(values, indices) of the k largest (smallest), NaN the largest, in sorted order (also for
    sorted=False, whose order PyTorch leaves open)."""
    x = env(imp, node.args[0])
    k = arg(node, 1, "k")
    dim, largest = arg(node, 2, "dim", -1), arg(node, 3, "largest", True)
    if not shape(x):
        return emit(imp, relax.Tuple([x, relax.const(0, "int64")]))
    axis = dim % len(shape(x))
    if k == 0:
        shp = shape(x)
        shp[axis] = 0
        return emit(imp, relax.Tuple([emit(imp, relax.op.zeros(relax.ShapeExpr(shp), dtype(x))),
                                      emit(imp, relax.op.zeros(relax.ShapeExpr(shp), "int64"))]))
    found = emit(imp, relax.op.topk(sort_key(imp, x), k=k, axis=axis, ret_type="indices", largest=bool(largest),
                                    dtype="int64"))
    return emit(imp, relax.Tuple([emit(imp, relax.op.gather_elements(x, found, axis=axis)), found]))


@rule("median.default", "median.dim")
def median(imp, node):
    """The lower of the two middle values (value and index for median.dim), or where the slice
    holds a NaN, NaN and the index of its first NaN, as PyTorch: the position is found in x sorted
    stably, where the NaNs come last in their order."""
    x = env(imp, node.args[0])
    with_dim = node.target.__name__ == "median.dim"
    keepdim = arg(node, 2, "keepdim", False) if with_dim else False
    if not shape(x):
        return emit(imp, relax.Tuple([x, relax.const(0, "int64")])) if with_dim else x
    if not with_dim:
        x = emit(imp, relax.op.reshape(x, [-1]))
    axis = arg(node, 1, "dim") % len(shape(x)) if with_dim else 0
    n = shape(x)[axis]
    if n == 0:
        raise NotImplementedError("median of an empty slice (PyTorch raises)")
    order = _sorted_indices(imp, x, axis, False)
    at = relax.const((n - 1) // 2, "int64")
    if is_float(dtype(x)):
        wide = cast(imp, x, "float64" if dtype(x) == "float64" else "float32")
        nans = emit(imp, relax.op.sum(cast(imp, emit(imp, relax.op.isnan(wide)), "int64"), axis=[axis], keepdims=True))
        at = emit(imp, relax.op.where(relax.op.greater(nans, relax.const(0, "int64")),
                                      relax.op.subtract(relax.const(n, "int64"), nans), at))
    else:
        at = emit(imp, relax.op.full([1 if d == axis else s for d, s in enumerate(shape(x))], at, "int64"))
    index = emit(imp, relax.op.gather_elements(order, at, axis=axis))
    value = emit(imp, relax.op.gather_elements(x, index, axis=axis))
    if not with_dim:
        return emit(imp, relax.op.reshape(value, []))
    if not keepdim:
        value, index = (emit(imp, relax.op.squeeze(t, axis=[axis])) for t in (value, index))
    return emit(imp, relax.Tuple([value, index]))


@rule("histc.default")
def histc(imp, node):
    """Counts of the elements in `bins` equal bins over [min, max], in the input's dtype;
    elements outside (and NaN) are not counted, one equal to max is in the last bin. The bin is
    (x - min) * bins / (max - min) truncated, as PyTorch's kernels compute it: floating point
    in the input's dtype (its CPU kernel), integers in int64 (its CUDA kernel: the CPU one takes
    none). min == max (the data's own range) is not lowered."""
    x = env(imp, node.args[0])
    bins = int(arg(node, 1, "bins", 100))
    lo, hi = arg(node, 2, "min", 0), arg(node, 3, "max", 0)
    dt = dtype(x)
    if lo == hi:
        raise NotImplementedError("histc over the data's own range (min == max): it depends on the values")
    if bins <= 0 or hi < lo:
        raise NotImplementedError(f"histc with bins={bins}, min={lo}, max={hi} (PyTorch raises)")
    if is_float(dt) and dt not in ("float32", "float64"):
        raise NotImplementedError(f"histc of {dt} (PyTorch's CPU kernel has none to match)")
    flat = emit(imp, relax.op.reshape(x, [-1]))
    wide = flat if is_float(dt) else emit(imp, relax.op.astype(flat, "int64"))
    at = dt if is_float(dt) else "int64"
    lo_c, hi_c = relax.const(lo if is_float(dt) else int(lo), at), relax.const(hi if is_float(dt) else int(hi), at)
    inside = emit(imp, relax.op.logical_and(relax.op.greater_equal(wide, lo_c), relax.op.less_equal(wide, hi_c)))
    scaled = relax.op.multiply(relax.op.subtract(wide, lo_c), relax.const(bins, at))
    if is_float(dt):
        pos = relax.op.astype(relax.op.where(inside, relax.op.divide(scaled, relax.op.subtract(hi_c, lo_c)),
                                             relax.const(0, dt)), "int64")
    else:  # x - min >= 0 where it counts: floor division is the truncating one
        pos = relax.op.floor_divide(scaled, relax.op.subtract(hi_c, lo_c))
    pos = emit(imp, pos)
    pos = emit(imp, relax.op.minimum(pos, relax.const(bins - 1, "int64")))  # max itself: the last bin
    hits = emit(imp, relax.op.logical_and(
        relax.op.equal(relax.op.expand_dims(pos, 1), relax.const(np.arange(bins, dtype="int64")[None, :])),
        relax.op.expand_dims(inside, 1)))
    counts = emit(imp, relax.op.sum(relax.op.astype(hits, "int64"), axis=[0]))
    return emit(imp, relax.op.astype(counts, dt))
