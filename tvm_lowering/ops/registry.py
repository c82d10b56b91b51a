"""The lowering table itself: `RULES` (ATen overload name -> rule), `TIR_RULES`, and `@rule`, which fills them.

A module of its own rather than the package's __init__: the rule modules import it and
__init__ imports them, so the dependency points one way.
"""
RULES = {}
TIR_RULES = set()  # names whose rule emits a call_tir (see `rule`)
SCRIPT_RULES = {}  # name -> rule used only in a jit.script forward (see `rule`)


def rule(*names, wraps=False, tir=False, script=False):
    """Register `fn` as the lowering rule of each ATen overload in `names`.

    A second rule for the same overload is an error unless it says `wraps=True`
    (it calls the one it replaces, as the library rules do): two modules
    silently shadowing each other is how a fix gets lost.

    `tir=True` says the rule emits its own TIR kernel (call_tir) in place of a TVM
    rule made of Relax ops. Relax's Gradient cannot differentiate a call_tir, so the
    forward of a `ratex.jit.script` (differentiated inside TVM) keeps TVM's rule for it.

    `script=True` registers a rule for a jit.script forward only: Relax ops that Relax's
    Gradient differentiates, for a composite op the lazy device never records as such (it
    sees the op's parts, each with its own rule).
    """

    def register(fn):
        if script:
            SCRIPT_RULES.update(dict.fromkeys(names, fn))
            return fn
        for name in names:
            if name in RULES and not wraps:
                raise ValueError(f"a lowering rule for {name} is already registered ({RULES[name]})")
            RULES[name] = fn
        if tir:
            TIR_RULES.update(names)
        return fn

    return register
