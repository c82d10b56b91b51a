"""max_pool2d's gradient over windows that tile the input, as a gather TVM can vectorize.

relax Gradient (`ratex.jit.script`) differentiates `max_pool2d` into
`relax.grad.max_pool2d_backward(dy, x)`, which has no indices: TVM legalizes it
into an unscheduled scatter, and PyTorch's kernel first recomputes the forward
with indices, which takes most of its time on the MNIST Net's 64x64x24x24 pool.
Where the windows tile the input (stride = window, no padding or
dilation, no leftover rows, windows up to 2x2: the usual pool), every element belongs to one
window, and its gradient is computed where it is:

    winner[n, c, i, j] = the place of window (i, j)'s max in its row-major scan
    dx[n, c, h, w] = dy[n, c, h // kh, w // kw] if (h, w) is that place else 0

The winner is PyTorch's exactly (aten/src/ATen/native/cpu/MaxPoolKernel.cpp scans
the window row by row and takes an element when `val > maxval || isnan(val)`):
the first of equal maxima, the last NaN if the window has one, the first element
when all are -inf. Other pools keep the library kernel or TVM's legalization, but for
adaptive average pools on the GPU (`ADAPTIVE`, below).
"""
import itertools
import math

from tvm import te, tirx

from .schedules import MATERIALIZE
from .simplify import static_shape


# The winner is a chain of selects written out per window element, and each step reads the
# last twice: the expression doubles per element (a 3x3 window's is far too slow to compile).
_MAX_WINDOW = 4


def tiles(kernel, stride, padding, dilation, in_hw, out_hw) -> bool:
    """Whether 2-D pooling windows tile a plane exactly: stride = window, no padding or
    dilation, no rows or columns left over. Then every element lies in one window."""
    kernel, in_hw, out_hw = [int(k) for k in kernel], [int(v) for v in in_hw], [int(v) for v in out_hw]
    return ([int(v) for v in stride] == kernel and not any(int(p) for p in padding)
            and all(int(d) == 1 for d in dilation) and min(out_hw) > 0
            and in_hw == [out_hw[0] * kernel[0], out_hw[1] * kernel[1]])


def select_winners(dy, shape, kernel, is_winner, name):
    """dx[.., h, w] = dy[.., h // kh, w // kw] where `is_winner(window, h, w)` (window: the
    index of (h, w)'s window in dy), else 0: one select per element, which vectorizes along
    the row and fuses with what follows."""
    kh, kw = kernel
    zero = tirx.const(0, dy.dtype)

    def grad(*i):
        window = (*i[:-2], i[-2] // kh, i[-1] // kw)
        return tirx.Select(is_winner(window, i[-2], i[-1]), dy(*window), zero)

    return te.compute(shape, grad, name=name)


def windows_tile(call) -> bool:
    """Whether a `relax.grad.max_pool2d_backward` call's windows tile its NCHW input
    exactly (see `tiles`) with windows of at most 4 elements."""
    a = call.attrs
    dy, x = call.args
    kernel = [int(k) for k in a.pool_size]
    if (a.layout, a.out_layout) != ("NCHW", "NCHW") or len(kernel) != 2 or len(x.ty.shape) != 4:
        return False
    shapes = list(x.ty.shape)[2:] + list(dy.ty.shape)[2:]
    if not all(isinstance(s, tirx.IntImm) for s in shapes):
        return False
    return (tiles(kernel, a.strides, a.padding, a.dilation, shapes[:2], shapes[2:])
            and kernel[0] * kernel[1] <= _MAX_WINDOW)


def _max_pool2d_backward(bb, call):
    if not windows_tile(call):
        return call.op.get_attr("FLegalize")(bb, call)
    kh, kw = (int(k) for k in call.attrs.pool_size)
    return bb.call_te(lambda dy, x: _gather(dy, x, kh, kw), *call.args, primfunc_name_hint="max_pool2d_backward")


def _gather(dy, x, kh, kw):
    n, c, oh, ow = (int(s) for s in dy.shape)

    def argmax(b, ch, i, j):
        """The window's winner, as PyTorch's kernel scans it (its place in row-major order)."""
        best, place = x(b, ch, i * kh, j * kw), tirx.const(0, "int32")
        for q in range(1, kh * kw):
            val = x(b, ch, i * kh + q // kw, j * kw + q % kw)
            # TVM's isnan takes no bfloat16; widening to float32 keeps NaN.
            take = tirx.any(val > best, tirx.isnan(tirx.Cast("float32", val) if str(val.ty.dtype) == "bfloat16" else val))
            best, place = tirx.Select(take, val, best), tirx.Select(take, tirx.const(q, "int32"), place)
        return place

    # One winner per window (kh*kw times fewer elements than the input), then one select per element.
    winner = te.compute((n, c, oh, ow), argmax, name="max_pool2d_argmax", attrs={MATERIALIZE: 1})
    return select_winners(dy, x.shape, (kh, kw),
                          lambda window, h, w: winner(*window) == ((h % kh) * kw + w % kw).astype("int32"),
                          "max_pool2d_backward")


LEGALIZE = {"relax.grad.max_pool2d_backward": _max_pool2d_backward}


# An adaptive average pool's window sums are written out as one expression per output while the
# largest window has at most this many elements (a classifier head's 7x7 plane to 1x1 has 49)
_MAX_UNROLLED_WINDOW = 64


def _adaptive_avg_pool(bb, call):
    """relax.nn.adaptive_avg_pool1d/2d in the layout PyTorch uses, with static shapes and small
    windows, as an elementwise kernel (`_window_means`). TVM's own kernel nests a block per
    window inside a block per output, which no GPU schedule takes, and as a reduction over the
    widest window with the rest masked dlight's schedule fails the CUDA build ("cannot insert
    syncs inside condition"): a scripted adaptive pool (Swin's, a ResNet head's) ran on PyTorch."""
    from .ops.pooling import _adaptive_windows  # noqa: PLC0415  (ops imports the targets that import this)

    a, x = call.attrs, call.args[0]
    in_shape, out_shape = static_shape(x.ty), static_shape(call.ty)
    nd = len(in_shape) - 2 if in_shape else 0
    layout = {1: "NCW", 2: "NCHW"}.get(nd)
    if layout is None or out_shape is None or str(a.layout) != layout or str(a.out_layout) != layout:
        return call.op.get_attr("FLegalize")(bb, call)
    wins = _adaptive_windows(in_shape[2:], out_shape[2:])
    if math.prod(widest for _, _, widest in wins) > _MAX_UNROLLED_WINDOW:
        return call.op.get_attr("FLegalize")(bb, call)
    return bb.call_te(lambda t: _window_means(t, in_shape[2:], out_shape[2:], wins), x,
                      primfunc_name_hint=f"adaptive_avg_pool{nd}d")


def _window_means(x, sizes, out_sizes, wins):
    """Each output the mean of its window (`wins`: ops/pooling.py's adaptive windows), summed as
    one expression over the widest window's positions, those past the window's end masked
    (their reads clamped into the plane)."""
    dt = str(x.dtype)

    def mean(*idx):
        lead, outs = idx[:2], idx[2:]
        starts = [start(o) for (start, _, _), o in zip(wins, outs)]
        ends = [end(o) for (_, end, _), o in zip(wins, outs)]
        total = tirx.const(0, dt)
        for offsets in itertools.product(*[range(widest) for _, _, widest in wins]):
            pos = [s + k for s, k in zip(starts, offsets)]
            inside = tirx.all(*[p < e for p, e in zip(pos, ends)])
            read = x[(*lead, *[tirx.min(p, n - 1) for p, n in zip(pos, sizes)])]
            total = total + tirx.Select(inside, read, tirx.const(0, dt))
        count = math.prod([e - s for s, e in zip(starts, ends)])
        return total / count.astype(dt)

    return te.compute((*x.shape[:2], *out_sizes), mean, name="adaptive_avg_pool")


# GPU only: on the CPU TVM's adaptive pool builds and runs.
ADAPTIVE = {"relax.nn.adaptive_avg_pool1d": _adaptive_avg_pool, "relax.nn.adaptive_avg_pool2d": _adaptive_avg_pool}
