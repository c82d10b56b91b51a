"""Relax clean-ups that TVM's pipeline does not do and ratex's graphs need.

`fold_transposes`: autograd of `linear` records t(mm(...t(x)...)) chains, so
the lowered step holds permute_dims(permute_dims(x)) — in the MLP benchmark a
1024x1024 weight gradient is transposed twice, and the first transpose would run as
a kernel of its own, a sizeable share of the step. Consecutive permute_dims are
composed into one, and a composition that is the identity is dropped.

`expand_attention`: relax.nn.attention (what a scripted
scaled_dot_product_attention becomes) as matmul, softmax, matmul. TVM
legalizes it as one unscheduled loop nest, far slower in the GPT benchmark
than the same matmuls and softmax in PyTorch's kernels. As
matmuls they go to the kernel library (or get TVM's matmul schedule), and the
softmax the forward computes is the one the gradient recomputes (the two are
built alike, see autodiff.attention_probs), so CSE keeps one.
"""
import tvm
from tvm import relax

from . import autodiff

_PERMUTE = tvm.ir.Op.get("relax.permute_dims")
_ATTENTION = tvm.ir.Op.get("relax.nn.attention")


def _axes(call, ndim):
    axes = call.attrs.axes
    return list(range(ndim))[::-1] if axes is None else [int(a) for a in axes]


def rewrite_functions(mutator, mod):
    """Run a relax.PyExprMutator made for `mod` over each of its Relax functions; return the new module."""
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gv, mutator.visit_expr(func))
    return mutator.builder_.get()


@relax.expr_functor.mutator
class _FoldTransposes(relax.PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not call.op.same_as(_PERMUTE) or not isinstance(call.args[0], relax.Var):
            return call
        inner = self.lookup_binding(call.args[0])
        if not isinstance(inner, relax.Call) or not inner.op.same_as(_PERMUTE):
            return call
        source = inner.args[0]
        ndim = len(source.ty.shape)
        first, second = _axes(inner, ndim), _axes(call, ndim)
        axes = [first[a] for a in second]  # out[i] = inner[.. second ..] = source[.. first[second] ..]
        if axes == list(range(ndim)):
            return source
        return relax.op.permute_dims(source, axes)


@tvm.transform.module_pass(opt_level=0, name="RatexFoldTransposes")
def fold_transposes(mod, _ctx):
    """Compose consecutive permute_dims; drop the ones that cancel."""
    return rewrite_functions(_FoldTransposes(mod), mod)


@relax.expr_functor.mutator
class _ExpandAttention(relax.PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not call.op.same_as(_ATTENTION) or not autodiff.attention_expandable(call):
            return call
        _, _, vt, p = autodiff.attention_probs(self.builder_, *call.args, call.attrs)
        return relax.op.permute_dims(relax.op.matmul(p, vt), [0, 2, 1, 3])


@tvm.transform.module_pass(opt_level=0, name="RatexExpandAttention")
def expand_attention(mod, _ctx):
    """relax.nn.attention without bias or window as matmul, softmax, matmul."""
    return rewrite_functions(_ExpandAttention(mod), mod)
