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
"""
import collections
import functools
import threading

import tvm
import tvm_ffi
from tvm import relax

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


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
    return relax.transform.LegalizeOps(table)
