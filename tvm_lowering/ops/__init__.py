"""The ratex lowering table: rules that TVM's torch frontend lacks or gets wrong.

A rule is `fn(importer, node) -> relax.Expr`, registered by ATen overload name
(`"convolution_backward.default"`) with `@rule(...)`. Rules here take
precedence over the ones inherited from `tvm.relax.frontend.torch`.
"""
RULES = {}
TIR_RULES = set()  # names whose rule emits a call_tir (see `rule`)


def rule(*names, wraps=False, tir=False):
    """Register `fn` as the lowering rule of each ATen overload in `names`.

    A second rule for the same overload is an error unless it says `wraps=True`
    (it calls the one it replaces, as the library rules do): two modules
    silently shadowing each other is how a fix gets lost.

    `tir=True` says the rule emits its own TIR kernel (call_tir) in place of a TVM
    rule made of Relax ops. Relax's Gradient cannot differentiate a call_tir, so the
    forward of a `ratex.jit.script` (differentiated inside TVM) keeps TVM's rule for it.
    """

    def register(fn):
        for name in names:
            if name in RULES and not wraps:
                raise ValueError(f"a lowering rule for {name} is already registered ({RULES[name]})")
            RULES[name] = fn
        if tir:
            TIR_RULES.update(names)
        return fn

    return register


from . import arith, backward, coverage, nn, precise, random, script, views, special, gamma, corners, indexing, compile_extras, library  # noqa: E402,F401  (registration side effects)
# library must come last: its rules wrap the ones registered before it
