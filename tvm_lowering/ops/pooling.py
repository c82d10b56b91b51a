"""Pooling forward ops: max pool with indices, average pools, adaptive pools, windowed and ordered
as PyTorch's CPU kernels do (TVM's rules ignore divisor_override, get 3-D windows wrong and return
no shape for unbatched adaptive pools). Their backward ops are in backward.py.
"""
import math

import numpy as np
from tvm import relax, te, tirx

from .kit import arg, cast, emit, emit_te, env, is_float, isnan, out_meta, pair, pool_window
from .registry import rule


# ---- max_pool2d_with_indices / max_pool3d_with_indices ----------------------------------------
def torch_argmax(dt):
    """(reducer, padding) for PyTorch's CPU max-pool window scan, over (int64 index, value) pairs.

    PyTorch scans each window in row-major order and replaces the current max only by
    a strictly greater value or a NaN: ties go to the smallest index, NaN beats
    everything and among NaNs the last one wins. That is a total order on (value,
    index), so the reducer gives the same answer in any reduction order. `padding`
    is the (index, value) pair a position outside the input reads as: (huge, -inf).
    """
    floating = is_float(dt)
    ninf = tirx.const(-np.inf, dt) if floating else tirx.min_value(dt)
    big = tirx.const(np.iinfo(np.int64).max, "int64")

    def combine(a, b):
        i0, v0 = a
        i1, v1 = b
        if floating:
            n0, n1 = isnan(v0), isnan(v1)
            take = tirx.any(
                tirx.all(n1, tirx.any(tirx.Not(n0), i1 > i0)),
                tirx.all(tirx.Not(n0), tirx.Not(n1), tirx.any(v1 > v0, tirx.all(v1 == v0, i1 < i0))),
            )
        else:
            take = tirx.any(v1 > v0, tirx.all(v1 == v0, i1 < i0))
        return tirx.Select(take, i1, i0), tirx.Select(take, v1, v0)

    def identity(t0, t1):
        return big, ninf

    return te.comm_reducer(combine, identity, name="torch_argmax"), (big, ninf)


def _maxpool_te(x, kernel, stride, padding, dilation, out_sizes):
    """Values and int64 flat indices (in each plane or volume, row-major) of a max pool over the
    last len(kernel) dims (see torch_argmax)."""
    n = len(kernel)
    sizes = x.shape[-n:]
    argmax, (big, ninf) = torch_argmax(str(x.dtype))
    axes = [te.reduce_axis((0, k), name=f"k{i}") for i, k in enumerate(kernel)]

    def body(*idx):
        lead_idx, out_idx = idx[:-n], idx[-n:]
        pos = [o * s - p + r * d for o, s, p, r, d in zip(out_idx, stride, padding, axes, dilation)]
        valid = tirx.all(*[tirx.all(q >= 0, q < size) for q, size in zip(pos, sizes)])
        flat = pos[0]
        for q, size in zip(pos[1:], sizes[1:]):
            flat = flat * size + q
        v = tirx.if_then_else(valid, x[(*lead_idx, *pos)], ninf)
        i = tirx.Select(valid, flat.astype("int64"), big)
        return argmax((i, v), axis=axes)

    inds, vals = te.compute((*x.shape[:-n], *out_sizes), body, name=f"max_pool{n}d_with_indices")
    return vals, inds


@rule("max_pool2d_with_indices.default", "max_pool3d_with_indices.default")
def max_pool_with_indices(imp, node):
    x = env(imp, node.args[0])
    n = 3 if node.target.__name__.startswith("max_pool3d") else 2
    kernel, stride, padding = pool_window(node, n=n)
    dilation = pair(arg(node, 4, "dilation", 1), n)
    out_shape, _ = out_meta(node, 0)
    return _argmax_pool(imp, _maxpool_te, x, kernel, stride, padding, dilation, out_shape[-n:])


def _argmax_pool(imp, te_fn, x, *args):
    """(values, indices) of a pool reduced by torch_argmax; a bfloat16 input is pooled in float32
    (exact both ways), as TVM's bfloat16 legalization mistypes the reducer's bindings."""
    dt = str(x.ty.dtype)
    out = emit_te(imp, te_fn, cast(imp, x, "float32") if dt == "bfloat16" else x, *args)
    vals = cast(imp, emit(imp, relax.TupleGetItem(out, 0)), dt)
    return emit(imp, relax.Tuple([vals, emit(imp, relax.TupleGetItem(out, 1))]))


# ---- avg_pool2d / avg_pool3d ------------------------------------------------------------------
def _avg_pool_te(x, kernel, stride, padding, out_sizes, count_include_pad, divisor):
    """Average pool over the last len(kernel) dims, as PyTorch's CPU kernel counts the window.

    A window is clipped to the padded input (input + padding on each side);
    without count_include_pad it is further clipped to the input itself.
    """
    n = len(kernel)
    sizes = x.shape[-n:]
    dt = str(x.dtype)

    def body(*idx):
        lead_idx, out_idx = idx[:-n], idx[-n:]
        starts = [o * s - p for o, s, p in zip(out_idx, stride, padding)]
        acc = tirx.const(0, dt)
        for offs in np.ndindex(*kernel):
            pos = [s + o for s, o in zip(starts, offs)]
            ok = tirx.all(*[tirx.all(q >= 0, q < size) for q, size in zip(pos, sizes)])
            acc = acc + tirx.if_then_else(ok, x[(*lead_idx, *pos)], tirx.const(0, dt))
        if divisor:
            div = tirx.const(divisor, "int32")
        else:
            ends = [tirx.min(s + k, size + p) for s, k, size, p in zip(starts, kernel, sizes, padding)]
            if not count_include_pad:
                starts = [tirx.max(s, 0) for s in starts]
                ends = [tirx.min(e, size) for e, size in zip(ends, sizes)]
            div = ends[0] - starts[0]
            for s, e in zip(starts[1:], ends[1:]):
                div = div * (e - s)
        return acc / div.astype(dt)

    return te.compute((*x.shape[:-n], *out_sizes), body, name=f"avg_pool{n}d")


@rule("avg_pool2d.default", "avg_pool3d.default")
def avg_pool(imp, node):
    """TVM's rules ignore divisor_override (and get 3-D windows wrong); this follows PyTorch's CPU kernel."""
    x = env(imp, node.args[0])
    n = 3 if node.target.__name__.startswith("avg_pool3d") else 2
    kernel = pair(arg(node, 1, "kernel_size"), n)
    stride = arg(node, 2, "stride", None)
    stride = pair(stride, n) if stride else kernel
    padding = pair(arg(node, 3, "padding", 0), n)
    cip = arg(node, 5, "count_include_pad", True)
    divisor = arg(node, 6, "divisor_override", None)
    out_shape, _ = out_meta(node)
    if imp.differentiable:
        return _relax_avg_pool2d(imp, x, n, kernel, stride, padding, arg(node, 4, "ceil_mode", False), cip, divisor)
    return emit_te(imp, _avg_pool_te, x, kernel, stride, padding, out_shape[-n:], cip, divisor)


def _relax_avg_pool2d(imp, x, n, kernel, stride, padding, ceil_mode, cip, divisor):
    """relax.nn.avg_pool2d, which Relax's Gradient differentiates (with autodiff's rule) in a
    jit.script forward; its windows and divisors are PyTorch's."""
    if n != 2 or divisor:
        raise NotImplementedError("a scripted avg_pool3d or divisor_override (no Relax gradient for them)")
    batched = len(x.ty.shape) == 4
    x4 = x if batched else emit(imp, relax.op.expand_dims(x, 0))
    out = emit(imp, relax.op.nn.avg_pool2d(x4, kernel, stride, padding, ceil_mode=bool(ceil_mode),
                                           count_include_pad=bool(cip)))
    return out if batched else emit(imp, relax.op.squeeze(out, [0]))


# ---- adaptive pools ---------------------------------------------------------------------------
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

    A scripted model records the composite adaptive_avg_pool2d instead (rule below).
    """
    x = env(imp, node.args[0])
    out_shape, _ = out_meta(node)
    nd = len(arg(node, 1, "output_size"))
    return emit_te(imp, _adaptive_pool_te, x, out_shape[-nd:], "avg")


@rule("adaptive_avg_pool2d.default")
def adaptive_avg_pool2d(imp, node):
    """The composite op a scripted model records: relax.nn.adaptive_avg_pool2d, which Relax's Gradient
    differentiates (autodiff's rule), on a batched or unbatched input (TVM's rule returns no shape
    for an unbatched one)."""
    x = env(imp, node.args[0])
    out_shape, _ = out_meta(node)
    batched = len(x.ty.shape) == 4
    x4 = x if batched else emit(imp, relax.op.expand_dims(x, 0))
    out = emit(imp, relax.op.nn.adaptive_avg_pool2d(x4, out_shape[-2:], layout="NCHW"))
    return out if batched else emit(imp, relax.op.squeeze(out, [0]))


@rule("adaptive_max_pool2d.default", "adaptive_max_pool3d.default")
def adaptive_max_pool(imp, node):
    """(values, indices): indices are flat positions in each input plane (volume), as PyTorch's."""
    x = env(imp, node.args[0])
    out_shape, _ = out_meta(node, 0)
    nd = len(arg(node, 1, "output_size"))
    return _argmax_pool(imp, _adaptive_pool_te, x, out_shape[-nd:], "max")


# ---- fractional_max_pool2d / fractional_max_pool3d --------------------------------------------
def _fractional_starts(sample, o, n_in, n_out, k, dt):
    """Where window `o` of a fractional max pool starts (TIR), from its plane's random `sample`:
    trunc((o + u) * alpha) - trunc(u * alpha), alpha = (in - k) / (out - 1), computed in the
    input's dtype as PyTorch's kernel does; the last window ends at the input's end."""
    last = tirx.const(n_in - k, "int32")
    if n_out == 1:
        return last
    alpha = tirx.const(np.array(n_in - k, dt) / np.array(n_out - 1, dt), dt)
    start = ((o.astype(dt) + sample) * alpha).astype("int32") - (sample * alpha).astype("int32")
    return tirx.Select(o == n_out - 1, last, start)


def _fractional_pool_te(x, samples, kernel, out_sizes):
    """Values and int64 flat indices of a fractional max pool over the last len(kernel) dims.

    samples[n, c, :] holds one number in [0, 1) per pooled dim, the last dim's first (W, H for
    2-D; PyTorch's 3-D kernel reads them T, H, W); positions are clamped so that samples outside
    [0, 1), which PyTorch does not check, read no memory outside x."""
    nd = len(kernel)
    lead = [int(s) for s in x.shape[:-nd]]
    sizes = [int(s) for s in x.shape[-nd:]]
    dt = str(x.dtype)
    order = [1, 0] if nd == 2 else [0, 1, 2]  # which sample each pooled dim reads
    axes = [te.reduce_axis((0, k), name=f"k{i}") for i, k in enumerate(kernel)]
    argmax, _ = torch_argmax(dt)

    def best(*idx):
        lead_idx, out_idx = idx[:-nd], idx[-nd:]
        plane = lead_idx if len(lead_idx) == 2 else (0, *lead_idx)  # unbatched: one row of samples
        pos = []
        for d in range(nd):
            u = samples[(*plane, order[d])]
            start = _fractional_starts(u, out_idx[d], sizes[d], out_sizes[d], kernel[d], dt)
            pos.append(tirx.max(tirx.min(start + axes[d], sizes[d] - 1), 0))
        flat = pos[0].astype("int64")
        for p, n in zip(pos[1:], sizes[1:]):
            flat = flat * n + p.astype("int64")
        return argmax((flat, x[(*lead_idx, *pos)]), axis=axes)

    inds, vals = te.compute((*lead, *out_sizes), best, name=f"fractional_max_pool{nd}d")
    return vals, inds


@rule("fractional_max_pool2d.default", "fractional_max_pool3d.default")
def fractional_max_pool(imp, node):
    """(values, indices), indices flat positions in each input plane (volume), as PyTorch's."""
    x, samples = env(imp, node.args[0]), env(imp, node.args[3])
    kernel, out_sizes = list(arg(node, 1, "kernel_size")), list(arg(node, 2, "output_size"))
    if str(x.ty.dtype) not in ("float32", "float64") or str(samples.ty.dtype) != str(x.ty.dtype):
        raise NotImplementedError("fractional max pool of a half-precision input (PyTorch computes its windows in it)")
    out = emit_te(imp, _fractional_pool_te, x, samples, kernel, out_sizes)
    return emit(imp, relax.Tuple([emit(imp, relax.TupleGetItem(out, i)) for i in (0, 1)]))
