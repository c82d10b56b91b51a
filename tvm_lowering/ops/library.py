"""Library dispatch: heavy ops (matmul, conv and its gradients) as calls to a kernel library.

TVM's untuned LLVM code for these is far slower than vendor kernels on
CPU; so is its code for softmax, log_softmax and GELU and their gradients
(exp and erf being scalar libm calls where torch's kernels vectorize) and for the embedding
gradient (a serial scatter-add loop), which go through the generic
`ratex.lib.aten` call. With `importer.library` set (`import_graph(library=True)`), these rules
emit `call_pure_packed("ratex.lib.<op>", ...)` instead. The runtime side registers those packed
functions: ratex/core/kernels.py in Python (PyTorch's own kernels through zero-copy DLPack),
replaced by csrc/kernels.cc's C++ versions of the same names where the native library is
built. Transposes feeding a matmul are folded into the call as flags, so no transposed copy
is made. Without the flag, each rule defers to the rule it overrides.
"""
import math

import torch
from tvm import relax

from ..dtypes import to_tvm
from ..library_dispatch import aten_call, out_call, packed_call, worth_library
from . import bounds
from .kit import arg, cast, emit, out_meta
from .registry import RULES, rule

aten_t = "t.default"


def _prev(name):
    """The rule this module overrides: an earlier ratex rule, else TVM's own."""
    earlier = RULES.get(name)
    return lambda imp, node: earlier(imp, node) if earlier is not None else imp.tvm_rules[name](node)


def _tensor_type(meta):
    shape, dtype = meta
    return relax.TensorType(shape, dtype)


def _operand(imp, x):
    """Relax value of matmul operand `x` and whether it is a folded transpose.

    Chains of t() fold too: autograd of `linear` gives mm(g, t(t(W))), whose inner
    transpose would otherwise run as a kernel (a full copy of a 1024x1024 weight)."""
    transposed = False
    while x.op == "call_function" and x.target.__name__ == aten_t and len(x.args[0].meta["val"].shape) == 2:
        x, transposed = x.args[0], not transposed
    return imp.env[x], transposed


def _batched_operand(imp, x):
    """Relax value of bmm operand `x` and whether it is a folded swap of its last two axes
    (the backward of attention multiplies by k.transpose(1, 2) and v.transpose(1, 2):
    each would be a 32x128x64 transpose kernel in the GPT benchmark)."""
    transposed = False
    while x.op == "call_function" and x.target.__name__ == "transpose.int" and \
            sorted(d % 3 for d in x.args[1:3]) == [1, 2] and len(x.args[0].meta["val"].shape) == 3:
        x, transposed = x.args[0], not transposed
    return imp.env[x], transposed


def _call(imp, name, args, attrs, ty):
    return imp.block_builder.emit(packed_call(name, args, attrs, ty))


def _call_out(imp, name, args, attrs, ty):
    """A kernel that writes into an output the program allocates (`ratex.lib.<name>_out`).

    Relax plans that buffer with the program's other intermediates, and the VM's pool
    reuses it every run. A tensor PyTorch allocates afresh costs page faults instead
    when it is large: the MLP's matmuls would run slower inside a training step than alone.
    """
    return imp.block_builder.emit(out_call(name, args, attrs, ty))


def _library_rule(name, build, macs=None, when=None):
    """Lower `name` with `build` when the importer dispatches to the library (and, given `macs`,
    the op's multiply-adds reach the importer's `library_min_macs`; given `when`, when(node)
    holds); else with the rule before."""
    fallback = _prev(name)

    def lower(imp, node):
        if not getattr(imp, "library", False) or (when is not None and not when(node)):
            return fallback(imp, node)
        if macs is not None and not worth_library(macs(node), imp.library_min_macs,
                                                  to_tvm(node.args[0].meta["val"].dtype)):
            return fallback(imp, node)  # small enough that TVM's code is faster (library_dispatch.py)
        return build(imp, node)

    rule(name, wraps=True)(lower)


def _mm(imp, node):
    (a, ta), (b, tb) = _operand(imp, node.args[0]), _operand(imp, node.args[1])
    return _call_out(imp, "mm", [a, b], {"ta": ta, "tb": tb}, _tensor_type(out_meta(node, None)))


def _addmm(imp, node):
    bias = imp.env[node.args[0]]
    (a, ta), (b, tb) = _operand(imp, node.args[1]), _operand(imp, node.args[2])
    attrs = {"ta": ta, "tb": tb, "beta": arg(node, 3, "beta", 1), "alpha": arg(node, 4, "alpha", 1)}
    return _call_out(imp, "addmm", [bias, a, b], attrs, _tensor_type(out_meta(node, None)))


def _bmm(imp, node):
    (a, ta), (b, tb) = _batched_operand(imp, node.args[0]), _batched_operand(imp, node.args[1])
    return _call_out(imp, "bmm", [a, b], {"ta": ta, "tb": tb}, _tensor_type(out_meta(node, None)))


def _conv_attrs(node, first):
    names = ("stride", "padding", "dilation", "transposed", "output_padding", "groups")
    return {n: arg(node, first + i, n) for i, n in enumerate(names)}


def _convolution(imp, node):
    x, w, b = node.args[0], node.args[1], node.args[2]
    attrs = _conv_attrs(node, 3)
    attrs["bias"] = b is not None
    args = [imp.env[x], imp.env[w]] + ([imp.env[b]] if b is not None else [])
    return _call(imp, "convolution", args, attrs, _tensor_type(out_meta(node, None)))


def _convolution_backward(imp, node):
    g, x, w = (imp.env[a] for a in node.args[:3])
    attrs = _conv_attrs(node, 4)
    attrs["bias_sizes"] = arg(node, 3, "bias_sizes")
    attrs["output_mask"] = list(arg(node, 10, "output_mask"))
    metas = [out_meta(node, i) for i in range(3)]
    types = [_tensor_type(m) if m is not None else relax.TensorType([1], "float32") for m in metas]
    return _call(imp, "convolution_backward", [g, x, w], attrs, relax.TupleType(types))


def _aten(imp, node):
    """Any single-output ATen op, called as itself: tensors are passed, other arguments are
    recorded in the call's attributes (ratex/core/kernels.py rebuilds the call)."""
    tensors, template = [], []
    for a in node.args:
        if isinstance(a, torch.fx.Node):
            template.append({"tensor": len(tensors)})
            tensors.append(imp.env[a])
        elif isinstance(a, torch.dtype):
            template.append({"dtype": str(a).replace("torch.", "")})
        else:
            template.append(a)
    kwargs = {k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v) for k, v in node.kwargs.items()}
    call = aten_call(str(node.target), tensors, template, kwargs, _tensor_type(out_meta(node, None)))
    return imp.block_builder.emit(call)


def _embedding_dense_backward(imp, node):
    """ATen's embedding gradient, its indices checked and clamped as the TVM rule's are (that
    rule's scatter-add is a serial loop, far slower than ATen's on the GPT benchmark's
    1024 x 256 rows into a 1000-row table)."""
    g, idx = imp.env[node.args[0]], imp.env[node.args[1]]
    rows = math.prod(_shape(node.args[1]))
    num_weights = arg(node, 2, "num_weights")
    padding_idx = arg(node, 3, "padding_idx", -1)
    index = bounds.index(imp, emit(imp, relax.op.reshape(cast(imp, idx, "int64"), [rows])), num_weights)
    grad = emit(imp, relax.op.reshape(g, [rows, _shape(node.args[0])[-1]]))
    template = [{"tensor": 0}, {"tensor": 1}, num_weights, -1 if padding_idx is None else padding_idx,
                bool(arg(node, 4, "scale_grad_by_freq", False))]
    ty = _tensor_type(out_meta(node, None))
    return imp.block_builder.emit(aten_call(str(node.target), [grad, index], template, {}, ty))


def _shape(x):
    return x.meta["val"].shape


def _product_macs(node, first=0):
    """mm / bmm (addmm: first=1, after the bias): output elements x the reduced length."""
    return math.prod(out_meta(node, None)[0]) * _shape(node.args[first])[-1]


def _conv_macs(node):
    """Forward convolution: output elements x one kernel's input slice (C/groups x kernel size)."""
    return math.prod(out_meta(node, None)[0]) * math.prod(_shape(node.args[1])[1:])


def _conv_backward_macs(node):
    """A forward's multiply-adds for each of the input and weight gradients asked for."""
    g, w = node.args[0], node.args[2]
    mask = list(arg(node, 10, "output_mask"))
    return math.prod(_shape(g)) * math.prod(_shape(w)[1:]) * (int(mask[0]) + int(mask[1]))


_library_rule("mm.default", _mm, _product_macs)
_library_rule("addmm.default", _addmm, lambda node: _product_macs(node, first=1))
_library_rule("bmm.default", _bmm, _product_macs)
_library_rule("convolution.default", _convolution, _conv_macs)
_library_rule("convolution_backward.default", _convolution_backward, _conv_backward_macs)
_library_rule("embedding_dense_backward.default", _embedding_dense_backward,
              when=lambda node: node.args[0].meta["val"].dtype in (torch.float32, torch.float64))
for _name in (
    "_softmax.default", "_log_softmax.default", "_softmax_backward_data.default", "_log_softmax_backward_data.default",
    "gelu.default", "gelu_backward.default",
):
    _library_rule(_name, _aten)
