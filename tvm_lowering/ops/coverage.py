"""Rules found missing or wrong by the OpInfo conformance run (scripts/conformance.py).

Each one is checked there against CPU PyTorch, on OpInfo's samples.
"""
from tvm import relax

from . import rule
from .nn import arg, emit, out_meta


@rule("full.default")
def full(imp, node):
    """Any shape, 0-dim included (TVM's rule fails on `[]`), in the dtype PyTorch inferred."""
    shp, dt = out_meta(node)
    value = relax.const(arg(node, 1, "fill_value"), dt)  # a 0-dim tensor: legalizing full() to () fails
    return value if not shp else emit(imp, relax.op.full(relax.ShapeExpr(shp), value, dt))
