"""The ratex lowering table: rules that TVM's torch frontend lacks or gets wrong.

A rule is `fn(importer, node) -> relax.Expr`, registered by ATen overload name
(`"convolution_backward.default"`) with `@rule(...)`. Rules here take
precedence over the ones inherited from `tvm.relax.frontend.torch`.
scripts/conformance.py checks them against CPU PyTorch on OpInfo's samples.

One module per op family, helpers they share in `kit`:

  elementwise  arithmetic and comparisons, clamps, casts, math functions
  reductions   sums, means, var/std, max/min and arg forms, norms, scans
  nn           losses, normalization, softmax, matrix products
  pooling      max, average and adaptive pools
  indexing     scatter, gather, index_select/put/reduce, take/put, cat
  views        view ops and their scatter inverses
  creation     fills, zeros/ones/full/empty and their *_like and new_* forms
  backward     the backward ops autograd emits
  special      the error-function family (erfc, erfcx, erfinv, ndtri)
  gamma        the gamma family (lgamma, digamma, polygamma, zeta) and Bessel I0/I1
  random       counter-based random bits and dropout's keep mask
  script       calls of converted TorchScript forwards and backwards
  library      matmul, convolution and friends as calls of the `ratex.lib.*` kernels
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


# Imported for their registrations; library comes last: its rules wrap the ones registered before it.
from . import (elementwise, reductions, nn, pooling, indexing, views, creation, backward,  # noqa: E402,F401
               special, gamma, random, script, library)
