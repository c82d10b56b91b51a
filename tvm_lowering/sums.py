"""Sums of many small products as one product of their concatenations.

relax Gradient accumulates the gradient of a tensor used many times as a chain of adds, one
term per use. An unrolled RNN uses its hidden-to-hidden weight once per time step, so its
weight gradient is the sum over steps of dgates_t^T @ h_t: as many small matmuls (a K of
the batch size) and as many adds of the weight's size, each a kernel call whose fixed cost
exceeds its work. The sum is one product of the terms' operands concatenated along the
contracted axis:

    sum_i A_i @ B_i = concat(A_i, axis=1) @ concat(B_i, axis=0)

and a sum of collapse_sum_to over a leading axis is one collapse_sum_to of the concatenation
(the RNN's bias gradient). The rewrite is exact up to the order of the float additions.

The gradient of a tensor read in slices (an RNN's input projection, one slice per time step;
an LSTM's gates, four slices of one product) is a sum of the slices' gradients padded with
zeros to the tensor's shape. Where the pads are along one axis and do not overlap, that sum is
the concatenation of the slices' gradients (zeros between them): exact, and one copy where
the sum read every pad at every element. Unit slices of a tensor of one axis fewer (a time
step's) are stacked.
Products are joined where they are outer-product-like (their operands, which the join copies,
are no larger than the result, whose adds it saves); a term whose value is read elsewhere too
stays as it is.
"""
import tvm
from tvm import relax

from .simplify import rewrite_functions, static_shape

_ADD = tvm.ir.Op.get("relax.add")
_MATMUL = tvm.ir.Op.get("relax.matmul")
_COLLAPSE = tvm.ir.Op.get("relax.collapse_sum_to")
_PERMUTE = tvm.ir.Op.get("relax.permute_dims")
_PAD = tvm.ir.Op.get("relax.nn.pad")
_UNIT_AXIS = (tvm.ir.Op.get("relax.reshape"), tvm.ir.Op.get("relax.expand_dims"))


def _count_uses(expr, uses):
    """Add each var's occurrences in `expr` to `uses`; vars inside anything but calls, tuples
    and tuple reads count twice (never taken as read only once)."""
    if isinstance(expr, relax.Var):
        uses[expr] = uses.get(expr, 0) + 1
    elif isinstance(expr, relax.Call):
        for arg in expr.args:
            _count_uses(arg, uses)
    elif isinstance(expr, relax.Tuple):
        for field in expr.fields:
            _count_uses(field, uses)
    elif isinstance(expr, relax.TupleGetItem):
        _count_uses(expr.tuple_value, uses)
    elif isinstance(expr, relax.Expr) and not isinstance(expr, relax.ExternFunc):
        relax.analysis.post_order_visit(
            expr, lambda e: uses.__setitem__(e, uses.get(e, 0) + 2) if isinstance(e, relax.Var) else None)


def _uses(func: relax.Function) -> dict:
    uses = {}

    def visit(e):
        if isinstance(e, relax.SeqExpr):
            for block in e.blocks:
                for b in block.bindings:
                    _count_uses(b.value, uses)
            _count_uses(e.body, uses)

    relax.analysis.post_order_visit(func.body, visit)
    return uses


def _same(a, b) -> bool:
    """Whether tensor types `a` and `b` are the same static shape and dtype."""
    shape = static_shape(a)
    return shape is not None and shape == static_shape(b) and str(a.dtype) == str(b.dtype)


def _transposed(value):
    """Whether `value` is a permute_dims swapping the two axes of a matrix."""
    if not isinstance(value, relax.Call) or not value.op.same_as(_PERMUTE) or len(value.args[0].ty.shape) != 2:
        return False
    axes = value.attrs.axes
    return axes is None or [int(a) for a in axes] == [1, 0]


@relax.expr_functor.mutator
class _JoinSums(relax.PyExprMutator):
    def __init__(self, mod, uses, inner):
        super().__init__(mod)
        self.uses, self.inner = uses, inner
        self.bound = None  # the var of the binding being visited
        self.concats = {}  # (vars, axis) -> the var of their concatenation, shared by the rewrites

    def visit_dataflow_block_(self, block):
        self.concats = {}  # a dataflow block's vars are not visible in the next block
        return super().visit_dataflow_block_(block)

    def visit_binding_block_(self, block):
        self.concats = {}
        return super().visit_binding_block_(block)

    def visit_var_binding_(self, binding):
        self.bound = binding.var
        super().visit_var_binding_(binding)

    def _sole(self, var):
        """The value of `var` where it and the vars it is bound to through are read once, else None."""
        value = var
        while isinstance(value, relax.Var):
            if self.uses.get(value, 0) != 1:
                return None
            value = self.lookup_binding(value)
        return value

    def _root(self, var):
        """`var`, or the var it is bound to through bindings of one var to another."""
        value = self.lookup_binding(var) if isinstance(var, relax.Var) else None
        while isinstance(value, relax.Var):
            var, value = value, self.lookup_binding(value)
        return var

    def _terms(self, call, out):
        """The terms of the sum `call` (an add), through adds of its type read only there."""
        for arg in call.args:
            value = self._sole(arg)
            if isinstance(value, relax.Call) and value.op.same_as(_ADD) and _same(arg.ty, call.ty):
                self._terms(value, out)
            else:
                out.append((arg, value))
        return out

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not call.op.same_as(_ADD) or self.bound in self.inner or static_shape(call.ty) is None:
            return call
        if not all(_same(a.ty, call.ty) for a in call.args):
            return call
        terms = self._terms(call, [])
        products = [(t, v) for t, v in terms if self._joinable_product(v)]
        collapses = [(t, v) for t, v in terms if self._joinable_collapse(v)]
        pads = _disjoint_pads(terms)
        joined, taken = [], set()
        for group, join in ((products, self._join_products), (collapses, self._join_collapses),
                            (pads, self._join_pads)):
            if len(group) >= 2:
                joined.append(join([v for _, v in group]))
                taken.update(id(t) for t, _ in group)
        if not joined:
            return call
        total = None
        for t in joined + [t for t, _ in terms if id(t) not in taken]:
            total = t if total is None else self.builder_.emit(relax.op.add(total, t))
        return total

    @staticmethod
    def _joinable_product(value):
        if not isinstance(value, relax.Call) or not value.op.same_as(_MATMUL):
            return False
        a, b = (static_shape(x.ty) for x in value.args)
        if a is None or b is None or len(a) != 2 or len(b) != 2:
            return False
        if any(str(x.ty.dtype) != str(value.ty.dtype) for x in value.args):
            return False
        (p, k), q = a, b[1]
        return k * (p + q) <= p * q  # the operands copied are no larger than the result

    @staticmethod
    def _joinable_collapse(value):
        if not isinstance(value, relax.Call) or not value.op.same_as(_COLLAPSE):
            return False
        x = static_shape(value.args[0].ty)
        return x is not None and len(x) >= 2 and static_shape(value.ty) == x[1:]

    def _concat(self, xs, axis):
        key = (tuple(xs), axis)
        if key not in self.concats:
            self.concats[key] = self.builder_.emit(relax.op.concat(relax.Tuple(list(xs)), axis))
        return self.concats[key]

    def _side(self, operands, axis):
        """The concatenation of 2-D matmul operands along `axis`; where all are transposes, the
        transpose of their sources' concatenation along the other axis (the kernel library reads
        a transposed operand in place)."""
        values = [self.lookup_binding(self._root(x)) for x in operands]
        if all(_transposed(v) for v in values):
            sources = [self._root(v.args[0]) for v in values]
            return self.builder_.emit(relax.op.permute_dims(self._concat(sources, 1 - axis), [1, 0]))
        return self._concat([self._root(x) for x in operands], axis)

    def _join_products(self, products):
        a = self._side([p.args[0] for p in products], 1)
        b = self._side([p.args[1] for p in products], 0)
        return self.builder_.emit(relax.op.matmul(a, b, out_dtype=products[0].attrs.out_dtype))

    def _join_pads(self, pads):
        """The sum of zero pads (_disjoint_pads) as the concatenation of what they pad, zeros
        between; a stack where every piece is one step of the axis, made from a tensor without it."""
        axis, size = _pad_axis(pads[0]), static_shape(pads[0].ty)
        pieces, at = [], 0
        for pad in sorted(pads, key=lambda p: int(p.attrs.pad_width[2 * axis])):
            begin = int(pad.attrs.pad_width[2 * axis])
            if begin > at:
                pieces.append(size[:axis] + [begin - at] + size[axis + 1:])
            pieces.append(pad.args[0])
            at = begin + static_shape(pad.args[0].ty)[axis]
        if at < size[axis]:
            pieces.append(size[:axis] + [size[axis] - at] + size[axis + 1:])
        dtype = pads[0].ty.dtype
        sources = [self._unit_source(p, axis) if isinstance(p, relax.Expr) else None for p in pieces]
        if all(x is not None for x in sources):
            return self.builder_.emit(relax.op.stack(relax.Tuple(sources), axis))
        return self.builder_.emit(relax.op.concat(relax.Tuple(
            [p if isinstance(p, relax.Expr) else relax.op.zeros(p, dtype) for p in pieces]), axis))

    def _unit_source(self, piece, axis):
        """The tensor that `piece` (one step of `axis`) is a reshape or expand_dims of, where that
        tensor's shape is the piece's without the axis; else None."""
        shape = static_shape(piece.ty)
        if shape is None or shape[axis] != 1:
            return None
        value = self.lookup_binding(self._root(piece)) if isinstance(piece, relax.Var) else None
        if not isinstance(value, relax.Call) or not any(value.op.same_as(op) for op in _UNIT_AXIS):
            return None
        source = value.args[0]
        if isinstance(source, relax.DataflowVar) and not isinstance(self._root(piece), relax.DataflowVar):
            return None  # the piece comes from an earlier block, where its source stays
        return source if static_shape(source.ty) == shape[:axis] + shape[axis + 1:] else None

    def _join_collapses(self, collapses):
        joined = self._concat([self._root(c.args[0]) for c in collapses], 0)
        return self.builder_.emit(relax.op.collapse_sum_to(joined, collapses[0].args[1]))


def _pad_axis(pad) -> int:
    """The one axis that zero pad `pad` pads (both its widths may be zero), or -1 where it pads
    several or is not a zero pad of a static shape."""
    if not isinstance(pad, relax.Call) or not pad.op.same_as(_PAD) or pad.attrs.pad_mode != "constant":
        return -1
    if pad.attrs.pad_value != 0.0 or static_shape(pad.ty) is None or static_shape(pad.args[0].ty) is None:
        return -1
    widths = [int(w) for w in pad.attrs.pad_width]
    if any(w < 0 for w in widths):
        return -1
    padded = [k for k in range(len(widths) // 2) if widths[2 * k] or widths[2 * k + 1]]
    return padded[0] if len(padded) == 1 else (0 if not padded else -1)


def _disjoint_pads(terms) -> list:
    """The (term, value) pairs of `terms` that are zero pads along one and the same axis whose
    padded slices do not overlap; [] where there are not two such."""
    pads = [(t, v) for t, v in terms if _pad_axis(v) >= 0]
    axes = {_pad_axis(v) for _, v in pads}
    if len(pads) < 2 or len(axes) != 1:
        return []
    axis = axes.pop()
    spans = sorted((int(v.attrs.pad_width[2 * axis]), static_shape(v.args[0].ty)[axis]) for _, v in pads)
    if any(begin + length > after for (begin, length), (after, _) in zip(spans, spans[1:])):
        return []
    dtype = {str(v.ty.dtype) for _, v in pads} | {str(v.args[0].ty.dtype) for _, v in pads}
    return pads if len(dtype) == 1 else []


def _inner_sums(func, uses) -> set:
    """Vars read once, by an add of their own type: partial sums, rewritten with the whole."""
    inner = set()

    def visit(e):
        if isinstance(e, relax.Call) and e.op.same_as(_ADD):
            for arg in e.args:
                if isinstance(arg, relax.Var) and uses.get(arg, 0) == 1 and _same(arg.ty, e.ty):
                    inner.add(arg)

    relax.analysis.post_order_visit(func.body, visit)
    aliases = []  # (var, the var it is bound to), in binding order

    def find(e):
        if isinstance(e, relax.SeqExpr):
            for block in e.blocks:
                aliases.extend((b.var, b.value) for b in block.bindings if isinstance(b.value, relax.Var))

    relax.analysis.post_order_visit(func.body, find)
    for var, source in reversed(aliases):
        if var in inner and uses.get(source, 0) == 1:
            inner.add(source)
    return inner


@tvm.transform.module_pass(opt_level=0, name="RatexJoinSums")
def join_sums(mod, _ctx):
    """Sums of small matmuls (collapse_sum_tos) as one matmul (collapse_sum_to) of concatenations."""
    uses, inner = {}, set()
    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            found = _uses(func)
            uses.update(found)
            inner |= _inner_sums(func, found)
    return rewrite_functions(_JoinSums(mod, uses, inner), mod)
