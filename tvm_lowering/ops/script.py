"""Calls of converted TorchScript forwards/backwards (`ratex::script_fwd`, `ratex::script_bwd`).

The node's first argument is the key under which `register` holds a
`tvm_lowering.scriptgraph.Script`; the rule inlines that script's Relax function
into the program being built, so fusion and common-subexpression elimination see
across the call (the forward recomputed by the backward is the same expression as
the forward). The forward's index checks become the program's, reported under the node.

A script is converted for the dtypes its tensors have for the user; where the program's data
have another (a float32 tensor stored as bfloat16), the call casts its arguments to the script's
dtypes and its results to the node's: the script computes in its own dtypes.
"""
from tvm import relax

from ..dtypes import to_tvm
from ..inline import inline
from . import bounds
from .registry import rule

_scripts = {}  # key -> Script


def register(key: str, script):
    """Make `script` (a scriptgraph.Script) reachable by `key` from the script_fwd/script_bwd rules."""
    _scripts[key] = script


def lookup(key: str):
    """Return the script registered under `key` (KeyError when none is)."""
    return _scripts[key]


def _inline(importer, node, which):
    """Emit the stored Relax function `which` ('fwd' or 'bwd') of the script named by the node's key."""
    key, args = node.args[0], node.args[1]
    fn = getattr(lookup(key), which)
    bb = importer.block_builder
    values = [_cast(bb, importer.env[a], _dtype(p.ty)) for a, p in zip(args, fn.params)]
    return inline(bb, fn, values)


def _dtype(ty):
    """The dtype of a tensor type, or None for another type."""
    return str(ty.dtype) if isinstance(ty, relax.TensorType) else None


def _cast(bb, value, dtype):
    """`value` as `dtype` where it is a tensor of another dtype, else `value` itself."""
    have = _dtype(value.ty)
    if dtype and have and have != dtype:
        return bb.emit(relax.op.astype(value, dtype))
    return value


def _results_as(bb, out, vals):
    """The tuple `out` with field i cast to the dtype of the meta tensor `vals[i]` (later fields
    as they are); `out` itself where every dtype agrees."""
    have = [_dtype(t) for t in out.ty.fields]
    want = [to_tvm(v.dtype) if v is not None else None for v in vals]
    if all(w is None or h is None or h == w for h, w in zip(have, want)):
        return out
    fields = [out.fields[i] if isinstance(out, relax.Tuple) else bb.emit(relax.TupleGetItem(out, i))
              for i in range(len(have))]
    return bb.emit(relax.Tuple([_cast(bb, f, w) if w else f for f, w in zip(fields, want + [None] * len(fields))]))


@rule("script_fwd.default")
def _script_fwd(importer, node):
    out = _inline(importer, node, "fwd")
    out = importer.block_builder.emit(out) if not isinstance(out, relax.Var) else out
    script = lookup(node.args[0])
    if script.checks:  # the forward's last output, after the model's outputs and new buffers
        rows = importer.block_builder.emit(relax.TupleGetItem(out, len(script.out_metas)))
        bounds.nest(importer, rows, script.checks)
    return _results_as(importer.block_builder, out, node.meta["val"])


@rule("script_bwd.default")
def _script_bwd(importer, node):
    out = _inline(importer, node, "bwd")  # (loss, (gradients...)), often as a tuple literal
    # Take the literal's field, not `(loss, grads)[1]`: next to a fusable producer of a gradient,
    # FuseOps grouped that indexing of a literal into an op-less function FuseTIR rejects.
    grads = out.fields[1] if isinstance(out, relax.Tuple) else relax.TupleGetItem(out, 1)
    return _results_as(importer.block_builder, importer.block_builder.emit(grads), node.meta["val"])
