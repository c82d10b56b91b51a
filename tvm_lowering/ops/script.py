"""Calls of converted TorchScript forwards/backwards (`ratex::script_fwd`, `ratex::script_bwd`).

The node's first argument is the key under which `register` holds a
`tvm_lowering.torchscript.Script`; the rule inlines that script's Relax function
into the program being built, so fusion and common-subexpression elimination see
across the call (the forward recomputed by the backward is the same expression as
the forward). The forward's index checks become the program's, reported under the node.
"""
from tvm import relax

from ..inline import inline
from . import bounds
from .registry import rule

_scripts = {}  # key -> Script


def register(key: str, script):
    """Make `script` (a torchscript.Script) reachable by `key` from the script_fwd/script_bwd rules."""
    _scripts[key] = script


def lookup(key: str):
    """Return the script registered under `key` (KeyError when none is)."""
    return _scripts[key]


def _inline(importer, node, which):
    """Emit the stored Relax function `which` ('fwd' or 'bwd') of the script named by the node's key."""
    key, args = node.args[0], node.args[1]
    fn = getattr(lookup(key), which)
    return inline(importer.block_builder, fn, [importer.env[a] for a in args])


@rule("script_fwd.default")
def _script_fwd(importer, node):
    out = _inline(importer, node, "fwd")
    out = importer.block_builder.emit(out) if not isinstance(out, relax.Var) else out
    script = lookup(node.args[0])
    if script.checks:  # the forward's last output, after the model's outputs and new buffers
        rows = importer.block_builder.emit(relax.TupleGetItem(out, len(script.out_metas)))
        bounds.nest(importer, rows, script.checks)
    return out


@rule("script_bwd.default")
def _script_bwd(importer, node):
    out = _inline(importer, node, "bwd")  # (loss, (gradients...)), often as a tuple literal
    # Take the literal's field, not `(loss, grads)[1]`: next to a fusable producer of a gradient,
    # FuseOps grouped that indexing of a literal into an op-less function FuseTIR rejects.
    grads = out.fields[1] if isinstance(out, relax.Tuple) else relax.TupleGetItem(out, 1)
    return importer.block_builder.emit(grads)
