"""The ratex lowering table: rules that TVM's torch frontend lacks or gets wrong.

A rule is `fn(importer, node) -> relax.Expr`, registered by ATen overload name
(`"convolution_backward.default"`) with `@rule(...)` (registry.py). Rules here take
precedence over the ones inherited from `tvm.relax.frontend.torch`.
scripts/conformance.py checks them against CPU PyTorch on OpInfo's samples.

One module per op family, helpers they share in `kit`, and in `bounds` the index checks of
every rule that reads or writes at indices held in a tensor:

  elementwise  arithmetic and comparisons, clamps, casts, math functions
  reductions   sums, means, var/std, max/min and arg forms, norms, scans
  nn           losses, normalization, softmax, matrix products, pixel shuffle
  pooling      max, average and adaptive pools
  indexing     scatter, gather, index_select/put/reduce, take/put, cat
  views        view ops and their scatter inverses
  creation     fills, zeros/ones/full/empty and their *_like and new_* forms
  backward     the backward ops autograd emits
  special      the error-function family (erfc, erfcx, erfinv, ndtri)
  gamma        the gamma family (lgamma, digamma, polygamma, zeta) and Bessel I0/I1
  grouped      grouped matrix products (mixture-of-experts layers), transformers' fallback op included
  random       counter-based random bits and dropout's keep mask
  script       calls of converted TorchScript forwards and backwards
  library      matmul, convolution and friends as calls of the `ratex.lib.*` kernels
"""
from .registry import RULES, SCRIPT_RULES, TIR_RULES, rule  # noqa: F401  (the table, read by importer.py)

# Imported for their registrations; library comes last: its rules wrap the ones registered before it.
from . import (elementwise, reductions, nn, pooling, indexing, views, creation, backward,  # noqa: F401
               special, gamma, grouped, random, script, library)
