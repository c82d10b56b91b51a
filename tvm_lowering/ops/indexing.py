"""Scatter reductions, flat take/put, running extremes and adaptive pools, following PyTorch's CPU kernels.

The scatters and scans are TIR loops run on the host rather than TVM's
`scatter_elements`, which has no mean, lets NaN lose a max/min, starts every
reduction from the input (no `include_self=False`) and misplaces writes when the
index is narrower than the input off the scattered dim. Host loops suit CPU
builds only (`imp.host_kernels`); elsewhere update/add scatters that TVM gets
right keep its GPU kernel and the rest fall back to PyTorch.
"""
import math

import numpy as np
from tvm import relax, te, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from . import rule
from .nn import arg, cast, dtype, emit, emit_te, env, nll_loss, out_meta, shape, torch_argmax, zeros


def _is_float(dt):
    return dt.startswith("float") or dt.startswith("bfloat")


def _emit_host_kernel(imp, name, fn, *args):
    """emit_te of a kernel written as host loops (te.extern): only where the module is built for the CPU.

    Elsewhere the node falls back to PyTorch (a CUDA build would run these loops on the host).
    """
    if not imp.host_kernels:
        raise NotImplementedError(f"{name} has only a CPU kernel")
    return emit_te(imp, fn, *args)


def _unravel(flat, sizes):
    """Coordinates of a row-major flat position over `sizes`."""
    coords = []
    for size in reversed(sizes):
        coords.append(tirx.floormod(flat, size))
        flat = tirx.floordiv(flat, size)
    return coords[::-1]


# ---- scatter reductions ----------------------------------------------------------------------
def _reducer(reduce, dt):
    """(combine(current, value), identity) of a scatter reduction; max/min let NaN win, as PyTorch does."""
    if reduce == "sum":
        return (lambda a, b: a + b), tirx.const(0, dt)
    if reduce == "prod":
        return (lambda a, b: a * b), tirx.const(1, dt)
    if reduce == "update":
        return (lambda a, b: b), tirx.const(0, dt)
    largest = reduce == "amax"
    if _is_float(dt):
        identity = tirx.const(-np.inf if largest else np.inf, dt)
        return (lambda a, b: tirx.Select(tirx.any(tirx.isnan(b), b > a if largest else b < a), b, a)), identity
    if largest:
        return tirx.max, tirx.min_value(dt)
    return tirx.min, tirx.max_value(dt)


def _scatter_te(x, index, src, axis, reduce, include_self):
    """out = x; then out[.., index[p], ..] = reduce(out[.., index[p], ..], src[p]) for every position p of index.

    `index[p]` replaces p's coordinate on `axis`. Without include_self every written
    element first starts from the reduction's identity. Negative indices count from
    the end; indices still out of range write nothing (PyTorch raises on them).
    One parallel task per index position off `axis` walks that axis serially, so no
    element is written by two tasks and the order is PyTorch's.
    """
    xs = [int(s) for s in x.shape]
    ishape = [int(s) for s in index.shape]
    dt = str(x.dtype)
    combine, identity = _reducer(reduce, dt)
    size = xs[axis]
    cols = [d for d in range(len(xs)) if d != axis]

    def gen(ins, outs):
        data, idx, values = (T.buffer_proxy(b) for b in ins)
        out = T.buffer_proxy(outs[0])
        with IRBuilder() as ib:
            with T.seq_scope():
                with T.parallel(0, math.prod(xs)) as i:
                    at = tuple(_unravel(i, xs))
                    out[at] = data[at]
                with T.parallel(0, math.prod(ishape[d] for d in cols)) as col:
                    coords = dict(zip(cols, _unravel(col, [ishape[d] for d in cols])))
                    for write in ([] if include_self else [lambda cur, v: identity]) + [combine]:
                        with T.serial(0, ishape[axis]) as k:
                            at = tuple(k if d == axis else coords[d] for d in range(len(xs)))
                            t = idx[at].astype("int64")
                            t = tirx.Select(t < 0, t + size, t)
                            with T.If(tirx.all(t >= 0, t < size)):
                                with T.Then():
                                    dst = tuple(t if d == axis else coords[d] for d in range(len(xs)))
                                    out[dst] = write(out[dst], values[at])
            return ib.get()

    return te.extern([x.shape], [x, index, src], gen, dtype=dt, name=f"scatter_{reduce}")


def scatter_into(imp, x, axis, index, src, reduce, include_self=True):
    """x (not 0-dim) scattered into by src at index along axis, reduced by `reduce`
    ("update", "sum", "prod", "mean", "amax", "amin"); index may be narrower than x and src
    wider than index on any dim.

    mean is the sum divided by how many values met at each element (x counting as one
    with include_self); integer means round down, as PyTorch's do.
    """
    xs, ishape = shape(x), shape(index)
    if 0 in ishape:
        return x
    if dtype(x) == "bool" and reduce != "update":
        raise NotImplementedError(f"scatter reduction '{reduce}' of a bool tensor")
    src = cast(imp, src, dtype(x))
    off_axis = [n for d, n in enumerate(xs) if d != axis]
    spans_x = off_axis == [n for d, n in enumerate(ishape) if d != axis]
    if not imp.host_kernels and reduce in ("update", "sum") and spans_x:
        # TVM's scatter_elements has a GPU kernel, and is right where index spans x off the axis.
        if shape(src) != ishape:
            src = emit(imp, relax.op.strided_slice(src, list(range(len(ishape))), [0] * len(ishape), ishape))
        reduction = "add" if reduce == "sum" else "update"
        return emit(imp, relax.op.scatter_elements(x, cast(imp, index, "int64"), src, axis=axis, reduction=reduction))
    if reduce != "mean":
        return _emit_host_kernel(imp, f"scatter '{reduce}'", _scatter_te, x, index, src, axis, reduce, include_self)
    total = _emit_host_kernel(imp, "scatter 'mean'", _scatter_te, x, index, src, axis, "sum", include_self)
    ones = emit(imp, relax.op.ones(relax.ShapeExpr(xs), dtype(x)))
    ones_src = emit(imp, relax.op.ones_like(src))
    count = _emit_host_kernel(imp, "scatter 'mean'", _scatter_te, ones, index, ones_src, axis, "sum", include_self)
    count = emit(imp, relax.op.maximum(count, relax.const(1, dtype(x))))  # nothing met x here: x / 1
    divide = relax.op.divide if _is_float(dtype(x)) else relax.op.floor_divide
    return emit(imp, divide(total, count))


def _as_vector(imp, *values):
    """0-dim values as 1-element vectors (scatter along dim 0 of a 0-dim tensor means its one element)."""
    return [v if v is None or shape(v) else emit(imp, relax.op.reshape(v, [1])) for v in values]


def _reshaped_like(imp, out, x):
    return out if shape(out) == shape(x) else emit(imp, relax.op.reshape(out, shape(x)))


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


# ---- flat take / put -------------------------------------------------------------------------
def _flat(imp, x):
    return emit(imp, relax.op.reshape(x, [-1]))


@rule("take.default")
def take(imp, node):
    """x's flattened elements at index (negatives count from the end), shaped like index."""
    x, index = env(imp, node.args[0]), env(imp, node.args[1])
    if math.prod(shape(x)) == 0:
        raise NotImplementedError("take from an empty tensor (every index is out of range)")
    # "wrap" reads an in-range negative index as PyTorch does, and keeps any other read in bounds.
    out = emit(imp, relax.op.take(_flat(imp, x), _flat(imp, cast(imp, index, "int64")), axis=0, mode="wrap"))
    return emit(imp, relax.op.reshape(out, shape(index)))


@rule("put.default")
def put(imp, node):
    """x with its flattened elements at index set to (or, accumulating, increased by) source's."""
    x = env(imp, node.args[0])
    index, src = env(imp, node.args[1]), env(imp, node.args[2])
    reduce = "sum" if arg(node, 3, "accumulate", False) else "update"
    out = scatter_into(imp, _flat(imp, x), 0, _flat(imp, index), _flat(imp, src), reduce)
    return emit(imp, relax.op.reshape(out, shape(x)))


# ---- running extremes and log-sum-exp --------------------------------------------------------
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
    if not _is_float(dt) and dt not in ("int32", "int64"):
        data = cast(imp, data, "int32")  # LLVM rejects comparisons of bool and narrow integers

    def step(v, k, prev):
        if prev is None:
            return v, k
        best, where = prev
        take = v >= best if largest else v <= best
        if _is_float(dt):
            take = tirx.any(tirx.isnan(v), take)
        return tirx.Select(take, v, best), tirx.Select(take, k, where)

    name = "cummax" if largest else "cummin"
    out = _emit_host_kernel(imp, name, lambda t: _scan_te(t, step, (dtype(data), "int64"), name), data)
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
    if not _is_float(dt):
        raise NotImplementedError(f"logcumsumexp of {dt}")
    data = cast(imp, data, "float64")

    def step(v, k, prev):
        return (v,) if prev is None else (_log_add_exp(prev[0], v),)

    # One output: the extern returns a tensor, not a tuple.
    out = _emit_host_kernel(imp, "logcumsumexp", lambda t: _scan_te(t, step, ("float64",), "logcumsumexp"), data)
    return cast(imp, emit(imp, relax.op.reshape(out, shape(x))), dt)


# ---- adaptive pools --------------------------------------------------------------------------
def _adaptive_windows(in_sizes, out_sizes):
    """Per pooled dim: (start(o), end(o)) as TIR of the output position and the widest window.

    Window o covers [floor(o * in / out), ceil((o + 1) * in / out)), PyTorch's split.
    """
    wins = []
    for n, m in zip(in_sizes, out_sizes):
        widest = max(-(-(o + 1) * n // m) - o * n // m for o in range(m))
        wins.append((lambda o, n=n, m=m: tirx.floordiv(o * n, m),
                     lambda o, n=n, m=m: tirx.floordiv((o + 1) * n + m - 1, m), widest))
    return wins


def _adaptive_pool_te(x, out_sizes, kind):
    """Adaptive average ("avg") or max with int64 indices ("max") pool over the last len(out_sizes) dims."""
    nd = len(out_sizes)
    lead = [int(s) for s in x.shape[:-nd]]
    sizes = [int(s) for s in x.shape[-nd:]]
    wins = _adaptive_windows(sizes, out_sizes)
    axes = [te.reduce_axis((0, widest), name=f"k{i}") for i, (_, _, widest) in enumerate(wins)]
    dt = str(x.dtype)

    def window(out_idx):
        starts = [start(o) for (start, _, _), o in zip(wins, out_idx)]
        pos = [s + r for s, r in zip(starts, axes)]
        inside = tirx.all(*[p < end(o) for p, (_, end, _), o in zip(pos, wins, out_idx)])
        clamped = [tirx.min(p, n - 1) for p, n in zip(pos, sizes)]  # reads stay in bounds where not inside
        return starts, pos, inside, clamped

    if kind == "avg":
        def total(*idx):
            lead_idx, out_idx = idx[:-nd], idx[-nd:]
            _, _, inside, clamped = window(out_idx)
            return te.sum(tirx.if_then_else(inside, x[(*lead_idx, *clamped)], tirx.const(0, dt)), axis=axes)

        def mean(*idx):
            out_idx = idx[-nd:]
            count = math.prod([end(o) - start(o) for (start, end, _), o in zip(wins, out_idx)])
            return sums[idx] / count.astype(dt)

        sums = te.compute((*lead, *out_sizes), total, name=f"adaptive_sum_pool{nd}d")
        return te.compute((*lead, *out_sizes), mean, name=f"adaptive_avg_pool{nd}d")

    argmax, (big, ninf) = torch_argmax(dt)

    def best(*idx):
        lead_idx, out_idx = idx[:-nd], idx[-nd:]
        _, pos, inside, clamped = window(out_idx)
        flat = pos[0].astype("int64")
        for p, n in zip(pos[1:], sizes[1:]):
            flat = flat * n + p.astype("int64")
        v = tirx.if_then_else(inside, x[(*lead_idx, *clamped)], ninf)
        return argmax((tirx.Select(inside, flat, big), v), axis=axes)

    inds, vals = te.compute((*lead, *out_sizes), best, name=f"adaptive_max_pool{nd}d")
    return vals, inds


@rule("_adaptive_avg_pool2d.default", "_adaptive_avg_pool3d.default")
def adaptive_avg_pool(imp, node):
    """Over any leading dims (TVM's rules return no shape for an unbatched input).

    The composite adaptive_avg_pool*d that a scripted model records keep TVM's rules,
    which relax.transform.Gradient can differentiate.
    """
    x = env(imp, node.args[0])
    out_shape, _ = out_meta(node)
    nd = len(arg(node, 1, "output_size"))
    return emit_te(imp, _adaptive_pool_te, x, out_shape[-nd:], "avg")


@rule("adaptive_max_pool2d.default", "adaptive_max_pool3d.default")
def adaptive_max_pool(imp, node):
    """(values, indices): indices are flat positions in each input plane (volume), as PyTorch's."""
    x = env(imp, node.args[0])
    out_shape, _ = out_meta(node, 0)
    nd = len(arg(node, 1, "output_size"))
    out = emit_te(imp, _adaptive_pool_te, x, out_shape[-nd:], "max")
    return emit(imp, relax.Tuple([emit(imp, relax.TupleGetItem(out, i)) for i in (0, 1)]))


@rule("adaptive_max_pool2d_backward.default", "adaptive_max_pool3d_backward.default")
def adaptive_max_pool_backward(imp, node):
    """Each output gradient added into the input position its max came from."""
    grad, x, indices = (env(imp, a) for a in node.args[:3])
    nd = 3 if node.target.__name__.startswith("adaptive_max_pool3d") else 2
    xs, gs = shape(x), shape(grad)
    planes = math.prod(xs[:-nd])
    flat = [planes, math.prod(xs[-nd:])]
    grads = emit(imp, relax.op.reshape(grad, [planes, math.prod(gs[-nd:])]))
    where = emit(imp, relax.op.reshape(indices, [planes, math.prod(gs[-nd:])]))
    out = scatter_into(imp, zeros(imp, flat, dtype(grad)), 1, where, grads, "sum")
    return emit(imp, relax.op.reshape(out, xs))


# ---- group norm, 2-D nll ---------------------------------------------------------------------
@rule("native_group_norm.default")
def native_group_norm(imp, node):
    """(out, mean, rstd), mean and rstd of shape (N, group); TVM's rule returns only out."""
    x = env(imp, node.args[0])
    w, b = env(imp, arg(node, 1, "weight")), env(imp, arg(node, 2, "bias"))
    n, c, hw, group, eps = (node.args[i] for i in range(3, 8))
    xs, dt = shape(x), dtype(x)
    grouped = emit(imp, relax.op.reshape(x, [n, group, -1]))
    mean = emit(imp, relax.op.mean(grouped, axis=[2], keepdims=True))
    centered = emit(imp, relax.op.subtract(grouped, mean))
    var = emit(imp, relax.op.mean(relax.op.multiply(centered, centered), axis=[2], keepdims=True))
    rstd = emit(imp, relax.op.rsqrt(relax.op.add(var, relax.const(eps, dt))))
    out = emit(imp, relax.op.reshape(relax.op.multiply(centered, rstd), [n, c, hw]))
    if w is not None:
        out = emit(imp, relax.op.multiply(out, relax.op.reshape(w, [c, 1])))
    if b is not None:
        out = emit(imp, relax.op.add(out, relax.op.reshape(b, [c, 1])))
    out = emit(imp, relax.op.reshape(out, xs))
    stats = [emit(imp, relax.op.reshape(s, [n, group])) for s in (mean, rstd)]
    return emit(imp, relax.Tuple([out, *stats]))


@rule("nll_loss2d_forward.default")
def nll_loss2d_forward(imp, node):
    """nll_loss over (N, C, H, W) scores and (N, H, W) targets: the classes moved last, one row per pixel."""
    x, target = env(imp, node.args[0]), env(imp, node.args[1])
    xs = shape(x)
    if len(xs) != 4:
        raise NotImplementedError(f"nll_loss2d_forward of a {len(xs)}-dim input")
    rows = emit(imp, relax.op.reshape(emit(imp, relax.op.permute_dims(x, [0, 2, 3, 1])), [-1, xs[1]]))
    reduction = arg(node, 3, "reduction", 1)
    out, total = nll_loss(imp, rows, _flat(imp, target), env(imp, arg(node, 2, "weight")), reduction,
                          arg(node, 4, "ignore_index", -100), out_meta(node, 1)[0])
    if reduction == 0:
        out = emit(imp, relax.op.reshape(out, [xs[0], xs[2], xs[3]]))
    return emit(imp, relax.Tuple([out, total]))


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
