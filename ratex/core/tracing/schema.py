"""What an op's schema and dispatcher entry say about it: the arguments it writes, its
functional twin, whether it is composite; and PyTorch's names of dtypes for errors."""
import functools

import torch

aten = torch.ops.aten


@functools.lru_cache(maxsize=None)
def written(func):
    """Return [(kind, key)] of the arguments `func` writes: ('pos', i) or ('kw', name)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out.append(("kw", arg.name) if arg.kwarg_only else ("pos", i))
    return out


@functools.lru_cache(maxsize=None)
def functional_of(func):
    """Return the functional overload computing what `func` writes, or None."""
    name = func._schema.name.split("::")[1]
    overload = func._overloadname
    if name.endswith("_"):
        name = name[:-1]
        packet = getattr(aten, name, None)
        want = [(a.name, str(a.type)) for a in func._schema.arguments[1:]]
        pick = slice(1, None)  # transpose_.default vs transpose.int: match on the other arguments
        found = getattr(packet, overload, None) if packet is not None else None
        # Same overload name, same arguments: pow_.Scalar is pow.Tensor_Scalar, not pow.Scalar.
        if found is not None and [(a.name, str(a.type)) for a in found._schema.arguments[pick]] == want \
                and str(found._schema.arguments[0].type) == "Tensor":
            return found
    else:
        want = [(a.name, str(a.type)) for a in func._schema.arguments if not (a.alias_info and a.alias_info.is_write)]
        pick = slice(None)
    packet = getattr(aten, name, None)
    if packet is None:
        return None
    for ov in packet.overloads():
        cand = getattr(packet, ov)
        if cand is func or cand._schema.is_mutable:
            continue
        if [(a.name, str(a.type)) for a in cand._schema.arguments[pick]] == want and \
                (pick.start is None or str(cand._schema.arguments[0].type) == "Tensor"):
            return cand
    return None


@functools.lru_cache(maxsize=None)
def is_composite(func) -> bool:
    """Return whether `func` has a CompositeImplicitAutograd kernel (PyTorch decomposes it itself)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


def type_name(dtype) -> str:
    """PyTorch's ScalarType name of a dtype, as its error messages spell it (torch.int64: Long)."""
    return _TYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


_TYPE_NAMES = {
    torch.float64: "Double", torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16",
    torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
    torch.bool: "Bool", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
}
