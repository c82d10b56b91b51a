"""Guards and fixes for TVM rules whose results differ from PyTorch on some arguments.

Each rule here delegates to TVM's own rule for the cases it gets right and
raises for the rest, so those calls run eagerly instead of silently wrong.
"""
from tvm import relax

from . import rule


class Unsupported(NotImplementedError):
    """The rule does not handle these arguments; the op runs eagerly."""


def _arg(node, index, name, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


@rule("avg_pool2d.default")
def avg_pool2d(imp, node):
    if _arg(node, 6, "divisor_override") is not None:
        raise Unsupported("avg_pool2d with divisor_override")
    return imp._avg_pool2d(node)


@rule("sum.dim_IntList")
def sum_dim(imp, node):
    x = imp.env[node.args[0]]
    if x.ty.ndim == 0:  # summing a 0-dim tensor over dim 0 (or []) returns it unchanged
        dtype = str(node.meta["val"].dtype).replace("torch.", "")
        return x if str(x.ty.dtype) == dtype else imp.block_builder.emit(relax.op.astype(x, dtype))
    return imp._sum(node)
