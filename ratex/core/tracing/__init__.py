"""Tracing: how one ATen call on lazy tensors becomes IR, a view, a write, or an eager run.

`dispatch` (registry.py) is the whole policy, in order:
  1. handlers for ops that need care: sync points, copies and fills (fills.py), multi-output
     views and detach (views.py), in-place arithmetic on same-shape operands, recorded
     without result tensors (inplace.py), random ops (random.py);
  2. foreach ops, traced per element (foreach.py), and ratex's own decompositions into
     simpler ATen ops (decompose.py);
  3. view ops: share the base's Storage, extend the view chain (views.py);
  4. in-place and out= ops: compute functionally, then write through the view chain (inplace.py);
  5. functional ops: infer output metas (memoized) and record one node, none at all when
     every output is empty: those are device data at once (record.py);
an op without a meta kernel or a lowering rule is traced through PyTorch's own
decomposition (torch_decomp.py) when it has one whose outputs match, and otherwise
runs eagerly on CPU (eager.py; counter `aten::<op>`), its outputs becoming device data.
Arguments become node templates and inputs in capture.py; composite.py re-expresses
a few composite ops above autograd. Sparse COO tensors (an embedding's sparse gradient) are
`LazySparse` wrappers of lazy indices and values (sparse.py).

Importing this package registers every module's handlers, decompositions and paths
(`registry.register`, the one way to add an op) and installs `dispatch` as the
tracer of LazyTensor (tensor.install).
"""
from .. import tensor
from . import composite, decompose, fills, foreach, inplace, random, record, saved, sparse, views  # noqa: F401,E501  (they register)
from .registry import dispatch

tensor.install(dispatch=dispatch)

__all__ = ["dispatch"]
