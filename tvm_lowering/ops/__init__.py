"""The ratex lowering table: rules that TVM's torch frontend lacks or gets wrong.

A rule is `fn(importer, node) -> relax.Expr`, registered by ATen overload name
(`"convolution_backward.default"`) with `@rule(...)`. Rules here take
precedence over the ones inherited from `tvm.relax.frontend.torch`.
"""
RULES = {}


def rule(*names, wraps=False):
    """Register `fn` as the lowering rule of each ATen overload in `names`.

    A second rule for the same overload is an error unless it says `wraps=True`
    (it calls the one it replaces, as the library rules do): two modules
    silently shadowing each other is how a fix gets lost.
    """

    def register(fn):
        for name in names:
            if name in RULES and not wraps:
                raise ValueError(f"a lowering rule for {name} is already registered ({RULES[name]})")
            RULES[name] = fn
        return fn

    return register


from . import arith, backward, coverage, nn, precise, random, script, views, special, gamma, corners, indexing, library  # noqa: E402,F401  (registration side effects)
# library must come last: its rules wrap the ones registered before it
