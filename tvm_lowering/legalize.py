"""LegalizeOps that builds each distinct kernel once.

TVM's LegalizeOps calls an op's legalization for every call in the module: most build a
tensor expression and a PrimFunc from it, and the block builder then finds the PrimFunc equal
to one it holds already. A training step repeats the same op on the same shapes many times (an
unrolled LSTM: every time step, forward and backward), so most of that work is thrown away.
Here a call whose operands are all tensors of static shape is legalized once per (op,
attributes, operand types, result type): the next such call gets a call_tir of the same
PrimFunc with its own operands. Only a legalization that came out as exactly that, a call_tir
of a PrimFunc on the call's own operands in order, is reused; anything else (a composite, a
kernel taking shape variables, operands dropped or reordered) is legalized anew every time.
The PrimFuncs built are remembered for the modules compiled later in the process too (a
training step's ops are mostly those of the step before it, or of the forward before that).

Fills of constants (`zeros`, `ones`, their `_like` forms, `full` and `full_like` of a constant
value, `broadcast_to` of a constant; static shapes) become constants here, computed by numpy.
TVM's FoldConstant, where the target runs it (targets.py: GPU), would fold the same calls by
compiling each one's kernel with LLVM and running it, 60 ms or more a kernel. Only what
FoldConstant folds is folded: a fill of a constant value, and a `zeros` or `ones` (`_like`) of
at most its 1024 elements (larger ones stay fills at run time rather than constants in the
program).
"""
import collections
import functools
import threading

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
_FOLD_LIMIT = 1024  # FoldConstant's: larger creations from no tensor input stay runtime fills


def _static(ty) -> bool:
    """Whether `ty` is a tensor type of known dtype and a shape of constant extents."""
    if not isinstance(ty, relax.TensorType) or ty.shape is None or str(ty.dtype) == "":
        return False
    shape = ty.shape
    values = getattr(shape, "values", None)
    return values is not None and all(isinstance(v, tvm.tirx.IntImm) for v in values)


class _Shared:
    """The kernels legalizations built in this process, for the modules compiled after: (the
    legalization, the target, a call's hash) -> [(signature, PrimFunc, name)], at most
    `capacity` keys, the least recently used dropped first."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._kernels = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key, signature):
        with self._lock:
            for seen, func, name in self._kernels.get(key, ()):
                if tvm_ffi.structural_equal(seen, signature):
                    self._kernels.move_to_end(key)
                    return func, name
        return None

    def put(self, key, signature, func, name):
        with self._lock:
            self._kernels.setdefault(key, []).append((signature, func, name))
            self._kernels.move_to_end(key)
            while len(self._kernels) > self.capacity:
                self._kernels.popitem(last=False)


SHARED = _Shared()


class _Memo:
    """One op's legalization, remembering the kernels it built during one LegalizeOps run (and,
    through SHARED, in earlier ones)."""

    def __init__(self, legalize):
        self.legalize = legalize
        self.kernels = {}  # hash -> [(call, GlobalVar)], the calls that built each kernel

    def __call__(self, bb, call):
        args = list(call.args)
        if not args or not all(isinstance(a, relax.Var) and _static(a.ty) for a in args) or not _static(call.ty):
            return self.legalize(bb, call)
        signature = (call.attrs, [a.ty for a in args], call.ty, list(call.ty_args))
        key = tvm_ffi.structural_hash(signature)
        for seen, gvar in self.kernels.get(key, ()):
            if tvm_ffi.structural_equal(seen, signature):
                return _call(gvar, args, call.ty)
        # The legalization's identity and the target: rules differ between targets.
        shared_key = (id(self.legalize), str(tvm.target.Target.current(allow_none=True)), key)
        known = SHARED.get(shared_key, signature)
        if known is not None:
            gvar = bb.add_func(*known)  # the module's own copy, or the equal one it holds
            self.kernels.setdefault(key, []).append((signature, gvar))
            return _call(gvar, args, call.ty)
        out = self.legalize(bb, call)
        gvar = _kernel_of(out, args, call.ty)
        if gvar is not None:
            self.kernels.setdefault(key, []).append((signature, gvar))
            SHARED.put(shared_key, signature, bb.get()[gvar], gvar.name_hint)
        return out


def _static_shape(ty):
    """The shape of `ty` as a tuple of ints where `ty` is a static tensor type whose dtype numpy
    has, else None."""
    if not _static(ty) or str(ty.dtype) not in _NUMPY:
        return None
    return tuple(int(v) for v in ty.shape.values)


_NUMPY = {"float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"}


class _Fill:
    """A creation op's legalization that returns a constant, computed by numpy, where the call
    fills a static shape with a constant (see the module doc); else `legalize`'s."""

    def __init__(self, op: str, legalize):
        self.op, self.legalize = op, legalize

    def __call__(self, bb, call):
        value = self._value(call)
        return self.legalize(bb, call) if value is None else value

    def _value(self, call):
        shape = _static_shape(call.ty)
        if shape is None:
            return None
        dtype = str(call.ty.dtype)
        if self.op in _BY_SHAPE:
            if int(np.prod(shape)) > _FOLD_LIMIT:
                return None
            return relax.const(np.full(shape, _BY_SHAPE[self.op], dtype=dtype), dtype)
        # full(shape, fill), full_like(x, fill), broadcast_to(x, shape): a constant operand
        source = call.args[0] if self.op == "relax.broadcast_to" else call.args[1]
        if not isinstance(source, tvm.ir.expr.Constant) or _static_shape(source.ty) is None:
            return None
        data = source.value.numpy().astype(dtype)
        if self.op != "relax.broadcast_to" and data.ndim:
            return None
        return relax.const(np.broadcast_to(data, shape).copy(), dtype)  # (ascontiguousarray makes a 0-d array 1-d)


_BY_SHAPE = {"relax.zeros": 0, "relax.ones": 1, "relax.zeros_like": 0, "relax.ones_like": 1}
_FILLS = (*_BY_SHAPE, "relax.full", "relax.full_like", "relax.broadcast_to")


def _call(gvar, args, ty):
    return relax.Call(_CALL_TIR, [gvar, relax.Tuple(args)], None, [ty])


def _kernel_of(out, args, ty):
    """The PrimFunc's GlobalVar where `out` is a call_tir of it on exactly `args` with result type
    `ty`, else None."""
    if not (isinstance(out, relax.Call) and out.op.same_as(_CALL_TIR) and len(out.args) == 2):
        return None
    gvar, operands = out.args
    if not isinstance(gvar, tvm.ir.GlobalVar) or not isinstance(operands, relax.Tuple):
        return None
    if len(operands.fields) != len(args) or any(not f.same_as(a) for f, a in zip(operands.fields, args)):
        return None
    if len(out.ty_args) != 1 or not tvm_ffi.structural_equal(out.ty_args[0], ty):
        return None
    return gvar


@functools.lru_cache(maxsize=None)
def _registered() -> tuple:
    """(op name, legalization) of every op TVM registers one for."""
    table = []
    for name in tvm.ir.Op.list_op_names():
        op = tvm.ir.Op.get(name)
        if op.has_attr("FLegalize"):
            table.append((str(name), op.get_attr("FLegalize")))
    return tuple(table)


def legalize_ops(custom) -> tvm.transform.Pass:
    """LegalizeOps with the legalizations `custom` (op name -> function) before TVM's own, each
    distinct kernel built once (see the module doc). A new pass for every module: the kernels it
    remembers belong to the module it runs on."""
    table = {name: _Memo(fn) for name, fn in _registered()}
    table.update({name: _Memo(fn) for name, fn in dict(custom).items()})
    for name in _FILLS:
        if name in table:
            table[name] = _Fill(name, table[name])
    return relax.transform.LegalizeOps(table)
