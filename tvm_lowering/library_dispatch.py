"""A Relax pass that sends heavy ops (convolutions, matmul, pooling and embedding gradients, softmax, GELU) to the kernel library.

The ATen-level rules in ops/library.py cover ops that arrive as ATen calls;
this pass covers what is only Relax by the time it exists — the functions
that `ratex.jit.script` converts and differentiates with relax Gradient. It
rewrites each such call into `call_pure_packed("ratex.lib.<op>", ...)`, whose
implementations the runtime side registers (ratex/core/kernels.py).

Small products stay TVM code under `RATEX_KERNELS=auto` (`AUTO_MIN_MACS`).
"""
import json
import math

import tvm
from tvm import relax

from . import pool_grad
from .simplify import rewrite_functions

_FLOATS = ("float32", "float64")

# Under RATEX_KERNELS=auto, a matmul or convolution of fewer multiply-adds than this runs as
# TVM code (schedules.Contraction), larger ones in the library. PyTorch's CPU convolution
# has a fixed cost per call however small (LeNet-5 at batch 1, 0.1-0.5 M multiply-adds each,
# runs its convolutions much faster as TVM code), while TVM's tiles fall short of torch's
# sgemm on large matmuls (MLP 128x1024x1024).
AUTO_MIN_MACS = 1 << 20


def worth_library(macs: int, min_macs: int, dtype: str) -> bool:
    """Whether a product of `macs` multiply-adds in `dtype` goes to the library when float ones
    from `min_macs` up do. Half-precision products always go: PyTorch's kernels accumulate
    them in float32."""
    return dtype not in _FLOATS or macs >= min_macs


_PERMUTE = tvm.ir.Op.get("relax.permute_dims")


def _attrs(**kw):
    return tvm.ir.StringImm(json.dumps(kw))


def out_call(name, args, attrs: dict, ty):
    """`ratex.lib.<name>_out` on `args` with `attrs` (JSON) last, destination-passing: the
    kernel writes into an output the program allocates and plans (ratex/core/kernels.py)."""
    return relax.op.call_dps_packed(f"ratex.lib.{name}_out", relax.Tuple([*args, _attrs(**attrs)]), ty)


def packed_call(name, args, attrs: dict, ty):
    """`ratex.lib.<name>` on `args` with `attrs` (JSON) last; the kernel returns a new tensor."""
    return relax.op.call_pure_packed(f"ratex.lib.{name}", *args, _attrs(**attrs), ty_args=ty)


def aten_call(op: str, tensors, template: list, kwargs: dict, ty):
    """ATen `op` ("aten.<op>.<overload>") run by `ratex.lib.aten_out`: `template` lists its
    arguments, tensors as {"tensor": position in `tensors`}, the others as given."""
    return out_call("aten", tensors, {"op": op, "args": template, "kwargs": kwargs}, ty)


def _ints(xs):
    return [int(x) for x in xs]


def _dtype(expr):
    return str(expr.ty.dtype) if isinstance(expr.ty, relax.TensorType) else None


def _either(rewritten, call):
    return call if rewritten is None else rewritten  # (`or` would ask a relax Expr for its truth)


@relax.expr_functor.mutator
class _Dispatch(relax.PyExprMutator):
    def __init__(self, mod, min_macs=0):
        super().__init__(mod)
        self.min_macs = min_macs

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op) or _dtype(call) not in _FLOATS:
            return call
        name = call.op.name
        a = call.attrs
        if name in _PRODUCTS and not worth_library(_products_macs(name, call), self.min_macs, _dtype(call)):
            return call
        if name == "relax.nn.conv2d" and (a.data_layout, a.kernel_layout, a.out_layout) == ("NCHW", "OIHW", "NCHW"):
            cfg = _attrs(stride=_ints(a.strides), padding=_ints(a.padding), dilation=_ints(a.dilation), groups=int(a.groups))
            return self._packed("conv2d", call, [*call.args, cfg])
        pad = _ints(getattr(a, "padding", []) or [])
        symmetric = len(pad) == 4 and pad[0] == pad[2] and pad[1] == pad[3]
        if name == "relax.nn.conv2d_transpose" and (a.data_layout, a.kernel_layout) == ("NCHW", "IOHW") and symmetric:
            cfg = _attrs(
                stride=_ints(a.strides), padding=_ints(a.padding), output_padding=_ints(a.output_padding),
                dilation=_ints(a.dilation), groups=int(a.groups),
            )
            return self._packed("conv2d_transpose", call, [*call.args, cfg])
        if name == "relax.nn.conv2d" and (a.data_layout, a.kernel_layout, a.out_layout) == ("CNHW", "IOHW", "CNHW"):
            return _either(self._conv2d_weight_grad(call), call)
        if name == "relax.matmul" and all(_dtype(x) == _dtype(call) for x in call.args):
            (a, ta), (b, tb) = (self._untransposed(x) for x in call.args)
            return out_call("matmul", [a, b], {"ta": ta, "tb": tb}, call.ty)
        if name == "relax.grad.take_backward":
            return _either(self._take_backward(call), call)
        if name in _ATEN_CALLS:
            op, extra = _ATEN_CALLS[name]
            return aten_call(op, list(call.args), [{"tensor": 0}, *extra(a)], {}, call.ty)
        if name == "relax.grad.max_pool2d_backward" and pool_grad.windows_tile(call):
            return call  # TVM code is faster (pool_grad.py)
        if name in ("relax.grad.max_pool2d_backward", "relax.grad.avg_pool2d_backward") and symmetric:
            return _either(self._pool2d_grad(call, name.split(".")[-1]), call)
        return call

    def _pool2d_grad(self, call, name):
        """NCHW pooling gradients from relax Gradient, run by torch's kernels (TVM's pool_grad
        is an unscheduled scatter: several ms per LeNet pool at batch 64)."""
        a = call.attrs
        dilation = _ints(a.dilation)
        if (a.layout, a.out_layout) != ("NCHW", "NCHW") or (name.startswith("avg") and dilation != [1, 1]):
            return None  # torch's avg_pool2d has no dilation
        cfg = _attrs(
            kernel=_ints(a.pool_size), stride=_ints(a.strides), padding=_ints(a.padding)[:2], dilation=dilation,
            ceil_mode=bool(int(a.ceil_mode)), count_include_pad=bool(int(a.count_include_pad)),
        )
        return self._packed(name, call, [*call.args, cfg])

    def _take_backward(self, call):
        """relax Gradient's gradient of take along axis 0 of a matrix (an embedding), run by ATen's
        embedding_dense_backward: TVM's is a serial scatter-add loop, far slower on the GPT
        benchmark's table. take's indices are 1-d, and a differentiated take's are clamped
        (ops/bounds.py)."""
        grad, x, indices = call.args
        if call.attrs.axis is None or int(call.attrs.axis) != 0 or len(x.ty.shape) != 2:
            return None
        if _dtype(indices) not in ("int32", "int64") or len(indices.ty.shape) != 1:
            return None
        template = [{"tensor": 0}, {"tensor": 1}, int(x.ty.shape[0]), -1, False]
        return aten_call("aten.embedding_dense_backward.default", [grad, indices], template, {}, call.ty)

    def _conv2d_weight_grad(self, call):
        """relax Gradient's weight gradient of an NCHW conv: a conv of the input (read as CNHW)
        with the output gradient (read as IOHW), where the forward's stride is this conv's
        dilation and vice versa. Sent to torch's convolution_backward when the shapes are
        exactly those of a forward conv's gradient; otherwise left to TVM."""
        a = call.attrs
        x, dy = call.args
        pad = _ints(a.padding)
        if int(a.groups) != 1 or pad[0] != pad[2] or pad[1] != pad[3]:
            return None
        stride, dilation = _ints(a.dilation), _ints(a.strides)  # the forward conv's
        xs, gs, ws = (_ints(e.ty.shape) for e in (x, dy, call))
        if (ws[0], ws[1]) != (gs[1], xs[1]):
            return None
        for i in (0, 1):  # the forward output size torch will expect of dy
            if (xs[2 + i] + 2 * pad[i] - dilation[i] * (ws[2 + i] - 1) - 1) // stride[i] + 1 != gs[2 + i]:
                return None
        cfg = _attrs(stride=stride, padding=pad[:2], dilation=dilation, weight=ws)
        return self._packed("conv2d_weight_grad", call, [x, dy, cfg])

    def _untransposed(self, x):
        """(operand, flag): a matmul operand that is a swap of its last two axes is passed
        untransposed and flagged; the kernel reads it as a strided view. relax Gradient
        writes linear layers' gradients as matmuls of permute_dims, and each transpose
        would run as a copy kernel of its own (a sizeable share of the MLP's step)."""
        value = self.lookup_binding(x) if isinstance(x, relax.Var) else None
        if not isinstance(value, relax.Call) or not value.op.same_as(_PERMUTE):
            return x, False
        ndim = len(x.ty.shape)
        axes = list(range(ndim))[::-1] if value.attrs.axes is None else [int(a) for a in value.attrs.axes]
        if ndim < 2 or axes != [*range(ndim - 2), ndim - 1, ndim - 2]:
            return x, False
        return value.args[0], True

    def _packed(self, name, call, args):
        return relax.op.call_pure_packed(f"ratex.lib.{name}", *args, ty_args=call.ty)


_PRODUCTS = ("relax.nn.conv2d", "relax.nn.conv2d_transpose", "relax.matmul")
# Relax ops run as the ATen op of the same meaning: (op, its arguments after the tensor).
# TVM's kernels for these are scalar exp/erf loops (see ops/library.py), far slower than
# PyTorch's gelu and softmax in the scripted GPT benchmark.
_ATEN_CALLS = {
    "relax.nn.softmax": ("aten._softmax.default", lambda a: [int(a.axis), False]),
    "relax.nn.log_softmax": ("aten._log_softmax.default", lambda a: [int(a.axis), False]),
    "relax.nn.gelu": ("aten.gelu.default", lambda a: ["none"]),
    "relax.nn.gelu_tanh": ("aten.gelu.default", lambda a: ["tanh"]),
}


def _products_macs(name, call) -> int:
    """Multiply-adds of a conv2d / conv2d_transpose / matmul call."""
    out = math.prod(_ints(call.ty.shape))
    if name == "relax.matmul":
        return out * int(call.args[0].ty.shape[-1])
    w = _ints(call.args[1].ty.shape)
    out_channels = w[call.attrs.kernel_layout.index("O")]
    return out * math.prod(w) // max(out_channels, 1)  # each output reads a kernel's input slice


def library_dispatch_pass(min_macs: int = 0):
    """The pass rewriting conv2d / conv2d_transpose / matmul calls of at least `min_macs`
    multiply-adds, pooling and embedding gradients, softmax and GELU into ratex.lib.* packed calls."""

    @tvm.transform.module_pass(opt_level=0, name="RatexLibraryDispatch")
    def dispatch(mod, _ctx):
        return rewrite_functions(_Dispatch(mod, min_macs), mod)

    return dispatch


library_dispatch = library_dispatch_pass()
