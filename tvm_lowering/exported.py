"""torch.export's ExportedProgram -> Relax `fwd` (a Script), through the Builder the TorchScript path uses.

`ratex.jit.script` exports a model (`torch.export.export(model, args, strict=False)`
then `run_decompositions({})`) where TorchScript cannot capture it faithfully. That
program is functional ATen: views and in-place writes are resolved (a write through a
view is a `*_scatter`), buffers the forward writes are listed as BUFFER_MUTATION
outputs, and composite ops such as linear, layer_norm, attention and lstm stay whole.
Its graph already holds ATen OpOverloads; `convert` replays it call by call into a
`scriptgraph.Builder`, which gives the placeholders the Script order (inputs, attrs,
consts, masks) and rewrites training dropout and masked attention as it does for
TorchScript graphs. Lifted tensor constants become `consts` inputs (the only tensor
data that crosses into this module).
"""
import operator

import torch
from torch import fx
from torch.export.graph_signature import InputKind, OutputKind

from .scriptgraph import Builder, ConversionError, Script

aten = torch.ops.aten

# Checks that export leaves in the graph; a static-shape program has nothing left to check.
_CHECKS = {
    aten._assert_tensor_metadata.default, aten._assert_scalar.default, aten._assert_async.default,
    aten._assert_async.msg, aten.sym_constrain_range_for_size.default,
}


def graph_text(ep) -> str:
    """The program's graph code with its signature (a stable cache key)."""
    return f"{ep.graph_module.code}\n{ep.graph_signature}"


def convert(ep, attr_metas, diff_inputs=(), diff_attrs=None) -> Script:
    """Convert an ExportedProgram (functional ATen, static shapes) to a Script.

    attr_metas: {dotted path: (shape, dtype)} of the module's parameters and buffers.
    diff_inputs: indices of the user inputs that get gradients; diff_attrs: paths of
    the attributes that do (default: all floating-point ones the graph reads).
    Raises ConversionError (or tvm_lowering.LoweringError) when it cannot.
    """
    b = Builder()
    sig = ep.graph_signature
    inputs = {s.arg.name: s for s in sig.input_specs}
    env = {}
    outputs = []
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            env[node] = _placeholder(b, ep, inputs[node.name], node)
        elif node.op == "call_function":
            b.origin = (str(node.target), "")  # bounds.py reads TorchScript source ranges, not stacks
            if node.target in _CHECKS:
                continue
            args, kwargs = fx.map_arg((node.args, node.kwargs), lambda n: env[n])
            if node.target is operator.getitem:
                env[node] = args[0][args[1]]
            elif isinstance(node.target, torch._ops.OpOverload):
                if not isinstance(node.meta.get("val"), (torch.Tensor, tuple, list)):
                    raise ConversionError(f"{node.target} computes a Python value ({type(node.meta.get('val')).__name__})")
                env[node] = b.call(node.target, list(args), dict(kwargs))
            else:
                raise ConversionError(f"cannot convert {node.target} (not an ATen operator)")
        elif node.op == "output":
            for spec, value in zip(sig.output_specs, node.args[0]):
                value = env[value] if isinstance(value, fx.Node) else value
                if spec.kind == OutputKind.BUFFER_MUTATION:
                    b.writes[spec.target] = value
                elif spec.kind == OutputKind.USER_OUTPUT:
                    outputs.append(value)
                else:
                    raise ConversionError(f"the program has a {spec.kind.name} output ({spec.arg.name})")
        else:
            raise ConversionError(f"cannot convert a {node.op} node ({node.target})")
    return b.finish(outputs, None, attr_metas, diff_inputs, diff_attrs)


def _placeholder(b, ep, spec, node):
    val = node.meta.get("val")
    if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
        return b.attr(spec.target, tuple(val.shape), val.dtype)
    if spec.kind == InputKind.CONSTANT_TENSOR:
        t = ep.constants[spec.target]
        if not isinstance(t, torch.Tensor):
            raise ConversionError(f"the program holds a constant {type(t).__name__} ({spec.target})")
        return b.const(t)
    if spec.kind == InputKind.USER_INPUT and isinstance(val, torch.Tensor):
        return b.input(tuple(val.shape), val.dtype)
    raise ConversionError(f"the program takes a {spec.kind.name} input ({spec.arg.name})")
