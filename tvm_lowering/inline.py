"""`inline`: a Relax function's body emitted into the function being built.

The script_fwd/script_bwd lowering rules (ops/script.py) inline converted TorchScript forwards
and backwards into a step's program, and autodiff.vjp inlines the forward it differentiates.
It lives apart from the TorchScript converter (torchscript.py), which imports both of them.
"""
from tvm import relax


def inline(bb: relax.BlockBuilder, func: relax.Function, args) -> relax.Expr:
    """Emit `func`'s body into `bb`'s current block with `args` for its parameters; return its result.

    A fresh copy of the function is used each time, so the same function can be
    inlined several times into one program (Relax binds each variable once).
    """
    args = [a if isinstance(a, relax.Var) else bb.emit(a) for a in args]
    func = relax.utils.copy_with_new_vars(func)
    func = func.bind_params({p: a for p, a in zip(func.params, args)})
    body = func.body
    for block in body.blocks:
        for binding in block.bindings:
            bb.emit_normalized(binding)
    return body.body
