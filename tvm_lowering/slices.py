"""Slices of one tensor at many offsets as one kernel that takes the offsets (the CPU target's).

An unrolled RNN reads its input projection one time step at a time: for the LSTM LM's 32
steps, 32 slices of the same tensor that differ only in where they begin. Each slice that
fusion leaves on its own (a library call reads it) is a kernel of its own, scheduled and
compiled once per offset. Here a slice's kernel is tagged at legalization with what it
slices, and after fusion the slices left on their own that differ only in their offsets call
one kernel that takes the offsets as arguments. Slices fused into their readers keep their
constant offsets.
"""
import tvm
import tvm_ffi
from tvm import relax, te, tirx, topi

from .simplify import rewrite_functions, static_shape

TAG = "ratex.slice"  # on a slice's kernel: (axes, begins, strides), each a list of ints
_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def _ints(expr):
    fields = getattr(expr, "fields", None)
    if fields is None or not all(isinstance(f, tirx.IntImm) for f in fields):
        return None
    return [int(f.value) for f in fields]


def _spec(call):
    """(axes, begins, strides) of a strided_slice of static shapes whose every read is in
    bounds, with constant arguments; else None."""
    x, out = static_shape(call.args[0].ty), static_shape(call.ty)
    parts = [_ints(a) for a in call.args[1:]]
    if x is None or out is None or any(p is None for p in parts):
        return None
    axes, begins, _ = parts[:3]
    strides = parts[3] if len(parts) > 3 else [1] * len(axes)
    spec = ([], [], [])
    for axis, begin, stride in zip(axes, begins, strides):
        axis %= len(x)
        begin = begin + x[axis] if begin < 0 else begin
        last = begin + (out[axis] - 1) * stride
        if stride <= 0 or not (0 <= begin < x[axis] and 0 <= last < x[axis]):
            return None
        for part, value in zip(spec, (axis, begin, stride)):
            part.append(value)
    return spec


def _strided_slice(bb, call):
    """TVM's legalization (the same topi slice), its kernel tagged where it is a plain slice."""
    spec = _spec(call)
    if spec is None:
        return call.op.get_attr("FLegalize")(bb, call)
    data, axes, begin, end = call.args[:4]
    strides = list(call.args[4].fields) if len(call.args) > 4 else [tirx.IntImm("int64", 1)] * len(axes.fields)
    return bb.call_te(topi.strided_slice, data, list(begin.fields), list(end.fields), strides, list(axes.fields),
                      slice_mode="end", assume_inbound=call.attrs.assume_inbound, primfunc_name_hint="strided_slice",
                      primfunc_attrs={TAG: spec})


def _i64(values):
    """Ints as int64 constants, as relax's shapes and slice arguments are."""
    return [tirx.IntImm("int64", v) for v in values]


def _is_plain_slice(func, in_shape, dtype, axes, begins, strides) -> bool:
    """Whether `func` computes exactly the slice of `spec` (and nothing fused into it)."""
    data = te.placeholder(_i64(in_shape), dtype, "x")
    ends = [b + (int(func.params[1].ty.shape[a]) - 1) * s + 1 for a, b, s in zip(axes, begins, strides)]
    out = topi.strided_slice(data, _i64(begins), _i64(ends), _i64(strides), _i64(axes), slice_mode="end")
    return tvm_ffi.structural_equal(te.create_prim_func([data, out]).body, func.body, map_free_vars=True)


LEGALIZE = {"relax.strided_slice": _strided_slice}


def _kernel(in_shape, out_shape, dtype, axes, strides):
    """The slice of `in_shape` to `out_shape` along `axes`, its begins the kernel's arguments."""
    data = te.placeholder(_i64(in_shape), dtype, "x")
    begins = [tirx.Var(f"begin{k}", "int64") for k in range(len(axes))]

    def element(*index):
        at = list(index)
        for axis, begin, stride in zip(axes, begins, strides):
            at[axis] = begin + index[axis] * stride
        return data(*at)

    out = te.compute(_i64(out_shape), element, name="T_strided_slice_at")
    return te.create_prim_func([data, *begins, out]), begins


@relax.expr_functor.mutator
class _Share(relax.PyExprMutator):
    def __init__(self, mod, shared):
        super().__init__(mod)
        self.shared = shared  # the GlobalVar of a tagged kernel -> (the shared kernel's GlobalVar, begins)

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not call.op.same_as(_CALL_TIR) or call.args[0] not in self.shared:
            return call
        gv, begins = self.shared[call.args[0]]
        args = [*call.args[1].fields, *(relax.prim_value(tirx.IntImm("int64", b)) for b in begins)]
        return relax.call_tir(gv, relax.Tuple(args), call.ty)


@tvm.transform.module_pass(opt_level=0, name="RatexShareSlices")
def share_slices(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Tagged slice kernels (after fusion: those left on their own) that differ only in their
    begins become calls of one kernel taking the begins."""
    groups = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc) or func.attrs is None or TAG not in func.attrs:
            continue
        if len(func.params) != 2:
            continue
        axes, begins, strides = ([int(v) for v in part] for part in func.attrs[TAG])
        x, out = (p.ty for p in func.params)  # BufferTypes: shape and dtype
        in_shape = [int(v) for v in x.shape]
        if not _is_plain_slice(func, in_shape, str(x.dtype), axes, begins, strides):
            continue
        key = (tuple(in_shape), tuple(int(v) for v in out.shape), str(x.dtype), tuple(axes), tuple(strides))
        groups.setdefault(key, []).append((gv, begins))
    shared, kernels = {}, {}
    for (in_shape, out_shape, dtype, axes, strides), members in groups.items():
        if len(members) < 2:
            continue
        func, _ = _kernel(list(in_shape), list(out_shape), dtype, list(axes), list(strides))
        name = f"strided_slice_at{len(kernels)}"
        kernels[name] = func.with_attr("global_symbol", name)
        for gv, begins in members:
            shared[gv] = (name, begins)
    if not shared:
        return mod
    out = tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv not in shared}, attrs=mod.attrs,
                       global_infos=mod.global_infos)
    mutator = _Share(out, {})
    added = {name: mutator.builder_.add_func(func, name) for name, func in kernels.items()}
    mutator.shared = {gv: (added[name], begins) for gv, (name, begins) in shared.items()}
    return rewrite_functions(mutator, out)
