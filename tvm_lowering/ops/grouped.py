"""Grouped matrix products, the experts of mixture-of-experts layers: `aten::_grouped_mm`, and
transformers' `grouped_mm_fallback` and its backward (what transformers calls under
torch.compile for dtypes other than bfloat16), lowered to the same kernels.

`offs` holds the cumulative ends of the groups, contiguous runs of rows, columns or contraction
steps; it is a tensor computed on the device (from a router's top-k), so the kernels read it
when the program runs. A position's group is the number of ends at or before it: E (the number
of groups) for positions past the last end, whose output is zero (PyTorch leaves it
unspecified; transformers' fallback op zeroes it). Ends must not decrease, as PyTorch requires.
Each product is computed once: a row meets its own group's matrix, never all E of them.

The four layouts of `_grouped_mm(mat_a, mat_b, offs)`:
  2D x 3D  a (S, K), b (E, K, N): out (S, N), row s times b[group of s]    (a MoE layer's forward)
  3D x 2D  a (E, M, K), b (K, N): out (M, N), column n from a[group of n]
  2D x 2D  a (M, S), b (S, N): out (E, M, N), out[e] = a[:, rows of e] @ b[rows of e, :]
           (autograd's weight gradient; an empty group gives zeros)
  3D x 3D  a batched matmul, no offs
"""
import math

from tvm import relax, te, tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from .kit import accumulation, arg, dtype, emit, emit_te, env, shape, to_dtype, tuple_out, zeros
from .registry import rule

_FLOATS = ("float16", "bfloat16", "float32", "float64")
_GPU_THREADS = 256  # threads of a block of the GPU 2D x 2D kernel


# ---- kernels ----------------------------------------------------------------------------------
def _groups_te(offs, n):
    """The group of each of `n` positions: how many of the ends `offs` are at or before it (int32)."""
    e = te.reduce_axis((0, offs.shape[0]), name="e")
    return te.compute((n,), lambda s: te.sum((offs[e] <= tirx.Cast(offs.dtype, s)).astype("int32"), axis=e),
                      name="grouped_mm_groups")


def _rows_te(a, b, groups, acc):
    """out[s, n] = sum_k a[s, k] b[g, k, n], g the group of row s (the last one past the ends: masked later)."""
    (S, K), last = a.shape, b.shape[0] - 1
    k = te.reduce_axis((0, K), name="k")
    return te.compute(
        (S, b.shape[2]),
        lambda s, n: te.sum(a[s, k].astype(acc) * b[tirx.min(groups[s], last), k, n].astype(acc), axis=k),
        name="grouped_mm_rows")


def _columns_te(a, b, groups, acc):
    """out[m, n] = sum_k a[g, m, k] b[k, n], g the group of column n (the last one past the ends: masked later)."""
    (_, M, K), last = a.shape, a.shape[0] - 1
    k = te.reduce_axis((0, K), name="k")
    return te.compute(
        (M, b.shape[1]),
        lambda m, n: te.sum(a[tirx.min(groups[n], last), m, k].astype(acc) * b[k, n].astype(acc), axis=k),
        name="grouped_mm_columns")


def _contraction_te(a, b, groups, n_groups, acc, host):
    """out[e, m, n] = sum over the steps s of group e of a[m, s] b[s, n] (2D x 2D), in `acc`.

    A group's steps are known only when the program runs, so this is a loop nest rather than
    a TE reduction (whose extent is fixed): each (m, n) walks s once, adding into out[g, m, n],
    g the group of s; no two walks write one element. On the host, one parallel task per row m
    and the columns innermost; on a GPU, one thread per (m, n).
    """
    (M, S), N, E = (int(v) for v in a.shape), int(b.shape[1]), n_groups

    def gen(ins, outs):
        A, B, G = (T.buffer_proxy(x) for x in ins)
        out = T.buffer_proxy(outs[0])

        def add(m, s, n):
            out[G[s], m, n] = out[G[s], m, n] + A[m, s].astype(acc) * B[s, n].astype(acc)

        with IRBuilder() as ib:
            if host:
                with T.parallel(0, M) as m:
                    with T.serial(0, E) as e:
                        with T.serial(0, N) as n:
                            out[e, m, n] = tirx.const(0, acc)
                    with T.serial(0, S) as s:
                        with T.If(G[s] < E):
                            with T.Then():
                                with T.serial(0, N) as n:
                                    add(m, s, n)
            else:
                bx, tx = te.thread_axis("blockIdx.x"), te.thread_axis("threadIdx.x")
                with T.attr(bx, "thread_extent", math.ceil(M * N / _GPU_THREADS)):
                    with T.attr(tx, "thread_extent", _GPU_THREADS):
                        i = bx.var * _GPU_THREADS + tx.var
                        m, n = tirx.floordiv(i, N), tirx.floormod(i, N)
                        with T.If(i < M * N):
                            with T.Then():
                                with T.serial(0, E) as e:
                                    out[e, m, n] = tirx.const(0, acc)
                                with T.serial(0, S) as s:
                                    with T.If(G[s] < E):
                                        with T.Then():
                                            add(m, s, n)
            return ib.get()

    return te.extern([(E, M, N)], [a, b, groups], gen, dtype=acc, name="grouped_mm_contraction")


# ---- the four layouts -------------------------------------------------------------------------
def _groups(imp, offs, n):
    return emit_te(imp, _groups_te, offs, n, primfunc_name_hint="grouped_mm_groups")


def _past_ends_zero(imp, x, groups, n_groups, axis):
    """x with zeros where the group along `axis` is past the last one."""
    inside = emit(imp, relax.op.less(groups, relax.const(n_groups, "int32")))
    if axis == 0:
        inside = emit(imp, relax.op.expand_dims(inside, 1))
    return emit(imp, relax.op.where(inside, x, relax.const(0, dtype(x))))


def _each_its_group(imp, compute, a, b, offs, dt, out_shape, n_groups, positions, axis, name):
    """`compute` (a, b, the groups of `positions` along output `axis`, acc) -> out of
    `out_shape`, with zeros past the last group."""
    if n_groups == 0:
        return zeros(imp, out_shape, dt)
    groups = _groups(imp, offs, positions)
    out = emit_te(imp, compute, a, b, groups, accumulation(dt), primfunc_name_hint=name)
    return to_dtype(imp, _past_ends_zero(imp, out, groups, n_groups, axis), dt)


def rows_by_group(imp, a, b, offs, dt):
    """2D x 3D: out (S, N), row s of a (S, K) times b[its group] of b (E, K, N)."""
    S, N, E = shape(a)[0], shape(b)[2], shape(b)[0]
    return _each_its_group(imp, _rows_te, a, b, offs, dt, [S, N], E, S, 0, "grouped_mm_rows")


def columns_by_group(imp, a, b, offs, dt):
    """3D x 2D: out (M, N), column n of b (K, N) times a[its group] of a (E, M, K)."""
    E, M = shape(a)[:2]
    N = shape(b)[1]
    return _each_its_group(imp, _columns_te, a, b, offs, dt, [M, N], E, N, 1, "grouped_mm_columns")


def contraction_by_group(imp, a, b, offs, dt):
    """2D x 2D: out (E, M, N), out[e] = a[:, steps of e] @ b[steps of e, :] for a (M, S), b (S, N)."""
    E, (M, S), N = shape(offs)[0], shape(a), shape(b)[1]
    if S == 0:
        return zeros(imp, [E, M, N], dt)
    groups = _groups(imp, offs, S)
    out = emit_te(imp, _contraction_te, a, b, groups, E, accumulation(dt), imp.host_kernels,
                  primfunc_name_hint="grouped_mm_contraction")
    return to_dtype(imp, out, dt)


def _check(what, a, b, offs, layouts, names=("mat_a", "mat_b")):
    """Raise ValueError unless a, b (one float dtype; `names` in the messages) and offs (1-D
    int32/int64) fit one of `layouts`, (a dims, b dims) pairs, with a contraction dim that matches."""
    dims = (len(shape(a)), len(shape(b)))
    x, y = names
    if dims not in layouts:
        raise ValueError(f"{what}: {x} of shape {shape(a)} and {y} of shape {shape(b)}; the layouts lowered "
                         f"are {', '.join(f'{i}D x {j}D' for i, j in layouts)}")
    if dtype(a) not in _FLOATS or dtype(b) != dtype(a):
        raise ValueError(f"{what}: {x} is {dtype(a)} and {y} {dtype(b)}; both must be one of {', '.join(_FLOATS)}")
    if shape(a)[-1] != shape(b)[-2]:
        raise ValueError(f"{what}: the contraction dims differ: {x} {shape(a)}, {y} {shape(b)}")
    if offs is not None and (len(shape(offs)) != 1 or dtype(offs) not in ("int32", "int64")):
        raise ValueError(f"{what}: offs is {dtype(offs)} of shape {shape(offs)}; it must be 1-D int32 or int64")


# ---- rules ------------------------------------------------------------------------------------
@rule("_grouped_mm.default", tir=True)
def grouped_mm(imp, node):
    """aten::_grouped_mm in its four layouts (module doc); no bias, out_dtype none or mat_a's."""
    a, b = env(imp, node.args[0]), env(imp, node.args[1])
    offs = env(imp, arg(node, 2, "offs"))
    if arg(node, 3, "bias") is not None:
        raise ValueError("_grouped_mm: a bias is given; PyTorch supports none")
    layout = (len(shape(a)), len(shape(b)))
    _check("_grouped_mm", a, b, offs, [(2, 3), (3, 2), (2, 2), (3, 3)])
    if (offs is None) != (layout == (3, 3)):
        raise ValueError(f"_grouped_mm: offs is {'missing' if offs is None else 'given'} for the {layout[0]}D x "
                         f"{layout[1]}D layout; it is needed exactly where an operand is 2D")
    dt = dtype(a)
    if layout == (2, 3):
        return rows_by_group(imp, a, b, offs, dt)
    if layout == (3, 2):
        return columns_by_group(imp, a, b, offs, dt)
    if layout == (2, 2):
        return contraction_by_group(imp, a, b, offs, dt)
    return to_dtype(imp, emit(imp, relax.op.matmul(a, b, out_dtype=accumulation(dt))), dt)


def _transposed(imp, x):
    """x with its last two dims swapped."""
    axes = list(range(len(shape(x))))
    axes[-2:] = axes[-1], axes[-2]
    return emit(imp, relax.op.permute_dims(x, axes))


@rule("grouped_mm_fallback.default", tir=True)
def grouped_mm_fallback(imp, node):
    """transformers::grouped_mm_fallback(input (S, K), weight (E, K, N), offs): _grouped_mm's 2D x 3D."""
    x, w, offs = (env(imp, v) for v in node.args[:3])
    _check("grouped_mm_fallback", x, w, offs, [(2, 3)], ("input", "weight"))
    return rows_by_group(imp, x, w, offs, dtype(x))


@rule("grouped_mm_fallback_backward.default", tir=True)
def grouped_mm_fallback_backward(imp, node):
    """transformers::grouped_mm_fallback_backward(input, weight, offs, grad_output) ->
    (grad_input, grad_weight): grad_output @ weight[group]^T by rows, and input^T @ grad_output
    per group (the 2D x 2D layout)."""
    x, w, offs, g = (env(imp, v) for v in node.args[:4])
    _check("grouped_mm_fallback_backward", x, w, offs, [(2, 3)], ("input", "weight"))
    dt = dtype(x)
    grad_input = rows_by_group(imp, g, _transposed(imp, w), offs, dt)
    grad_weight = contraction_by_group(imp, _transposed(imp, x), g, offs, dt)
    return tuple_out(imp, node, [grad_input, grad_weight])
