"""Calls of converted TorchScript forwards/backwards (`ratex::script_fwd`, `ratex::script_bwd`).

The node's first argument is the key of a `tvm_lowering.torchscript.Script`;
the rule inlines that script's Relax function into the program being built,
so fusion and common-subexpression elimination see across the call (the
forward recomputed by the backward is the same expression as the forward).
"""
from tvm import relax

from . import rule


@rule("script_fwd.default")
def _script_fwd(importer, node):
    from .. import torchscript

    key, args = node.args[0], node.args[1]
    script = torchscript.lookup(key)
    bb = importer.block_builder
    out = torchscript.inline(bb, script.fwd, [importer.env[a] for a in args])
    return bb.emit(out) if not isinstance(out, relax.Var) else out


@rule("script_bwd.default")
def _script_bwd(importer, node):
    from .. import torchscript

    key, args = node.args[0], node.args[1]
    script = torchscript.lookup(key)
    bb = importer.block_builder
    out = torchscript.inline(bb, script.bwd, [importer.env[a] for a in args])
    return bb.emit(relax.TupleGetItem(out, 1))
