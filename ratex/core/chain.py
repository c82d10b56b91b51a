"""View chains on IR values: how a view's value follows from its base's, and back.

A lazy tensor is a base Storage plus the chain of view ops (op, spec) leading to
it. Reading replays the chain over the base's current value; writing a new value
into a view scatters it back through the chain (`*_scatter` ops, or the inverse
view) to give the base's new value, so that the base and all its views see it.
"""
import torch

from . import shape
from .ir import Node, fill, op_name, slot, template

aten = torch.ops.aten

# Views whose value is their input's: no node, so a detached parameter stays device data.
IDENTITY_VIEWS = {aten.detach.default, aten.alias.default}

_RESHAPES = {
    "view.default", "_unsafe_view.default", "_reshape_alias.default", "unsqueeze.default",
    "squeeze.default", "squeeze.dim", "squeeze.dims", "alias.default", "detach.default",
}
_SCATTERS = {
    "slice.Tensor": aten.slice_scatter.default,
    "select.int": aten.select_scatter.default,
    "diagonal.default": aten.diagonal_scatter.default,
    "as_strided.default": aten.as_strided_scatter.default,
}
_NO_KWARGS = ("__dict__", ())


def replay(func, spec, value):
    """Return the value of the view (func, spec) of `value`, recording its node."""
    if func in IDENTITY_VIEWS:
        return value
    meta = value[0].metas[value[1]]
    out = shape.infer(func, spec, ((meta.shape, shape.contiguous_strides(meta.shape), meta.dtype),))
    return (Node(func, spec, (value,), out.metas, key=out.key), 0)


def scatter_back(func, spec, base, new):
    """Return the new value of a view's base after the view (func, spec) became `new`."""
    name = op_name(func)
    (_, *rest), kwargs = fill(spec, [None])
    base_meta = base[0].metas[base[1]]
    new_meta = new[0].metas[new[1]]
    if name in _RESHAPES:
        return new if base_meta.shape == new_meta.shape else _emit(aten.view.default, (new,), list(base_meta.shape))
    if name in ("t.default", "transpose.int"):
        return _emit(func, (new,), *rest)
    if name == "permute.default":
        dims = [d % len(base_meta.shape) for d in rest[0]]
        return _emit(func, (new,), [dims.index(i) for i in range(len(dims))])
    if name in _SCATTERS:
        return _emit(_SCATTERS[name], (base, new), *rest, **kwargs)
    if name == "expand.default":
        raise RuntimeError(
            "unsupported operation: more than one element of the written-to tensor refers to a single "
            "memory location. Please clone() the tensor before performing the operation."
        )
    raise NotImplementedError(f"in-place writes through a view made by {name} are not supported on the lazy device")


def _emit(func, inputs, *args, **kwargs):
    """Record `func` with the IR values `inputs` as its leading tensor arguments; return its output."""
    spec = (
        tuple([slot(i) for i in range(len(inputs))] + [template(a, [], _no_tensor) for a in args]),
        ("__dict__", tuple([(k, template(v, [], _no_tensor)) for k, v in kwargs.items()])) if kwargs else _NO_KWARGS,
    )
    metas = []
    for node, idx in inputs:
        meta = node.metas[idx]
        metas.append((meta.shape, shape.contiguous_strides(meta.shape), meta.dtype))
    out = shape.infer(func, spec, tuple(metas))
    return (Node(func, spec, tuple(inputs), out.metas, key=out.key), 0)


def _no_tensor(x) -> bool:
    return False  # the arguments after the inputs come from a view's spec: no tensors among them
