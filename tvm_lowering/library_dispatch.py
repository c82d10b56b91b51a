"""A Relax pass that sends heavy ops (conv2d, conv2d_transpose, matmul) to the kernel library.

The ATen-level rules in ops/library.py cover ops that arrive as ATen calls;
this pass covers what is only Relax by the time it exists — the functions
that `ratex.jit.script` converts and differentiates with relax Gradient. It
rewrites each such call into `call_pure_packed("ratex.lib.<op>", ...)`, whose
implementations the runtime side registers (ratex/core/kernels.py).
"""
import json

import tvm
from tvm import relax

_FLOATS = ("float32", "float64")


def _attrs(**kw):
    return tvm.ir.StringImm(json.dumps(kw))


def _ints(xs):
    return [int(x) for x in xs]


def _dtype(expr):
    return str(expr.ty.dtype) if isinstance(expr.ty, relax.TensorType) else None


@relax.expr_functor.mutator
class _Dispatch(relax.PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)
        self.mod_ = mod

    def run(self):
        for gv, func in self.mod_.functions_items():
            if isinstance(func, relax.Function):
                self.builder_.update_func(gv, self.visit_expr(func))
        return self.builder_.get()

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op) or _dtype(call) not in _FLOATS:
            return call
        name = call.op.name
        a = call.attrs
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
        if name == "relax.matmul" and all(_dtype(x) == _dtype(call) for x in call.args):
            return self._packed("matmul", call, list(call.args))
        return call

    def _packed(self, name, call, args):
        return relax.op.call_pure_packed(f"ratex.lib.{name}", *args, ty_args=call.ty)


@tvm.transform.module_pass(opt_level=0, name="RatexLibraryDispatch")
def library_dispatch(mod, _ctx):
    """Rewrite conv2d / conv2d_transpose / matmul calls into ratex.lib.* packed calls."""
    return _Dispatch(mod).run()
