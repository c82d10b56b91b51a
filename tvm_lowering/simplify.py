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

`drop_dead_bindings`: the dataflow bindings nothing reads, dropped in one backward walk over
each function. TVM's DeadCodeElimination grows faster than the size of the function: 6 ms for
a GPT-2 step's 1,200 bindings, 0.4 s for an unrolled LSTM step's 5,800.
"""
import tvm
from tvm import relax

from . import autodiff

_PERMUTE = tvm.ir.Op.get("relax.permute_dims")
_ATTENTION = tvm.ir.Op.get("relax.nn.attention")


def _axes(call, ndim):
    axes = call.attrs.axes
    return list(range(ndim))[::-1] if axes is None else [int(a) for a in axes]


def static_shape(ty):
    """The shape of tensor type `ty` as ints, or None where it is not a tensor of static shape."""
    values = getattr(ty.shape, "values", None) if isinstance(ty, relax.TensorType) and ty.shape is not None else None
    if values is None or not all(isinstance(v, tvm.tirx.IntImm) for v in values):
        return None
    return [int(v) for v in values]


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


def _drop_dead(func):
    """`func` without the dataflow bindings that nothing reads (a binding outside a dataflow
    block may have effects: all stay), or None where it has none."""
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        return None
    used = set(relax.analysis.free_vars(body.body))
    blocks, dropped = [], False
    for block in reversed(body.blocks):
        dataflow = isinstance(block, relax.DataflowBlock)
        kept = []
        for binding in reversed(block.bindings):
            if dataflow and binding.var not in used:
                dropped = True
                continue
            kept.append(binding)
            used.update(relax.analysis.free_vars(binding.value))
        kept.reverse()
        blocks.append(relax.DataflowBlock(kept) if dataflow else relax.BindingBlock(kept))
    if not dropped:
        return None
    blocks.reverse()
    seq = relax.BlockBuilder().normalize(relax.SeqExpr(blocks, body.body))  # gives it its type
    return relax.Function(func.params, seq, func.ret_ty, func.is_pure, func.attrs, func.span)


@tvm.transform.module_pass(opt_level=0, name="RatexDropDeadBindings")
def drop_dead_bindings(mod, _ctx):
    """Drop the dataflow bindings nothing reads (see the module doc); functions nothing calls stay
    (TVM's DeadCodeElimination, run by FuseTIR, removes those later)."""
    changed = {gv: new for gv, func in mod.functions_items() if isinstance(func, relax.Function)
               for new in [_drop_dead(func)] if new is not None}
    if not changed:
        return mod
    bb = relax.BlockBuilder(mod)
    for gv, func in changed.items():
        bb.update_func(gv, func)
    return bb.get()
