"""TorchScript graph -> torch.fx.Graph of ATen OpOverloads -> Relax `fwd`; Relax Gradient -> `bwd`.

The TorchScript path shares the lazy path's lowering table: each `aten::name`
node becomes a call of the OpOverload its schema names (`aten::conv2d` ->
`torch.ops.aten.conv2d.default`), recorded by scriptgraph's `Builder`, which
infers metas on meta tensors and rewrites what Relax's Gradient cannot take
(training dropout, masked attention; see scriptgraph.py), and `import_graph`
lowers the fx graph with the same rules.

`convert` returns a `Script` (scriptgraph.py): the Relax forward
`fwd(inputs..., attrs..., consts..., masks...) -> (outputs..., new buffers...)`,
the output metas and structure, and, built on first use, the backward that
`relax.transform.Gradient` derives from `fwd`. Indices are checked as in every
program (ops/bounds.py): `Script.checks` and `Script.sites` name each checked op
and its source range.

TorchScript graphs do not say which values alias which, so in-place ops are
taken only where that cannot matter: a write to a parameter or buffer
(BatchNorm's running stats and `num_batches_tracked`) becomes an extra output
for the caller to write back, and a write to a fresh value rebinds it; a write
to a view, or to a value that has views, raises ConversionError (the
torch.export capture, which functionalizes views, takes such models). Scripts
are registered by key (`register`, from ops/script.py) so the
`script_fwd`/`script_bwd` lowering rules can find them. Only metas cross into
this module, never tensor data, except tensor constants baked into a trace,
which become extra `consts` inputs.
"""
import re

import torch
from torch import fx
from torch.utils import _pytree as pytree

from .ops.script import register  # noqa: F401  (ratex.jit registers each converted script through here)
from .scriptgraph import Builder, ConversionError, Script  # noqa: F401  (Script, ConversionError: public here too)

aten = torch.ops.aten


def graph_text(graph) -> str:
    """The TorchScript graph's text without source-location comments (a stable cache key)."""
    text = re.sub(r"\s*#[^\n]*", "", str(graph))
    return re.sub(r"___torch_mangle_\d+\.", "", text)  # each re-trace renames the module types


# ---- TorchScript -> fx ------------------------------------------------------------
def _overload(node):
    """Return the ATen OpOverload that a TorchScript `aten::` node calls."""
    kind = node.kind()
    name = kind.split("::", 1)[1]
    try:
        schema = torch._C.parse_schema(node.schema())
    except RuntimeError:
        raise ConversionError(f"{kind} has no schema") from None
    packet = getattr(aten, name, None)
    op = getattr(packet, schema.overload_name or "default", None) if packet is not None else None
    if op is None:
        raise ConversionError(f"{kind} ({schema.overload_name}) is not an ATen operator")
    return op


# c10::ScalarType's numbering: TorchScript passes a dtype argument as this int.
_SCALAR_TYPES = (
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32, torch.float64,
    torch.complex32, torch.complex64, torch.complex128, torch.bool, torch.qint8, torch.quint8, torch.qint32,
    torch.bfloat16,
)


def _with_dtypes(op, ins):
    """`ins` with each ScalarType argument as a torch.dtype (what the lowering rules expect)."""
    out = list(ins)
    for i, (a, x) in enumerate(zip(op._schema.arguments, ins)):
        if type(x) is int and "ScalarType" in str(a.real_type):
            out[i] = _SCALAR_TYPES[x]
    return out


def _functional_twin(op):
    """For an in-place `name_` overload return the functional `name` overload (or None)."""
    name = op._schema.name.split("::")[1]
    if not name.endswith("_") or name.startswith("_"):
        return None
    packet = getattr(aten, name[:-1], None)
    return getattr(packet, op._overloadname, None) if packet is not None else None


class _Converter(Builder):
    """Walks a TorchScript graph, recording its ATen calls with a Builder."""

    def __init__(self, graph, input_metas, attr_metas):
        super().__init__()
        self.ts = graph
        self.env = {}  # TorchScript value unique id -> python value / fx.Node / _Module / CPU tensor
        self.attr_metas = attr_metas
        self.aliased = set()  # fx nodes that share memory with another value in eager PyTorch
        ts_inputs = list(graph.inputs())
        if len(ts_inputs) != len(input_metas) + 1:
            raise ConversionError(f"graph takes {len(ts_inputs) - 1} inputs, {len(input_metas)} given")
        self.env[ts_inputs[0].unique()] = _Module("")
        for v, (shape, dtype) in zip(ts_inputs[1:], input_metas):
            self.env[v.unique()] = self.input(shape, dtype)

    def _attr(self, path):
        meta = self.attr_metas.get(path)
        if meta is None:
            raise ConversionError(f"module attribute {path!r} is not a parameter or buffer")
        return self.attr(path, *meta)

    def run(self):
        """Record every node; return the output values and the pytree spec of their structure."""
        for node in self.ts.nodes():
            self._node(node)
        outs = [self.env[v.unique()] for v in self.ts.outputs()]
        return pytree.tree_flatten(outs[0] if len(outs) == 1 else tuple(outs))

    # ---- one TorchScript node ------------------------------------------------
    def _node(self, node):
        self.origin = (node.kind(), node.sourceRange())
        kind = node.kind()
        ins = [self.env[v.unique()] for v in node.inputs()]
        outs = list(node.outputs())
        if kind == "prim::Constant":
            self._set(outs[0], outs[0].toIValue() if node.hasAttributes() else None)
        elif kind == "prim::GetAttr":
            owner = ins[0]
            path = f"{owner.path}.{node.s('name')}" if owner.path else node.s("name")
            is_module = outs[0].type().kind() == "ClassType"
            self._set(outs[0], _Module(path) if is_module else self._attr(path))
        elif kind in ("prim::ListConstruct", "prim::TupleConstruct"):
            self._set(outs[0], list(ins) if kind == "prim::ListConstruct" else tuple(ins))
        elif kind in ("prim::ListUnpack", "prim::TupleUnpack"):
            if len(ins[0]) != len(outs):
                raise ConversionError(f"{kind} of {len(ins[0])} items into {len(outs)}")
            for v, x in zip(outs, ins[0]):
                self._set(v, x)
        elif kind == "prim::TupleIndex" or kind == "aten::__getitem__":
            self._set(outs[0], ins[0][ins[1]])
        elif kind.startswith("aten::"):
            self._aten(node, ins, outs)
        elif kind == "prim::NumToTensor":
            self._set(outs[0], torch.tensor(ins[0]))
        else:
            raise ConversionError(f"unsupported TorchScript node {kind}")

    def _set(self, value, x):
        self.env[value.unique()] = x

    def _aten(self, node, ins, outs):
        op = _overload(node)
        if op is aten._convolution.default:  # what tracing records for conv: same math, fewer flags
            op, ins = aten.convolution.default, ins[:9]
        ins = _with_dtypes(op, ins)
        if op is aten.batch_norm.default:
            self._batch_norm(outs[0], *ins[:8])
            return
        rebind = written_path = None
        if op._schema.is_mutable:
            twin = _functional_twin(op)
            written = [i for i, a in enumerate(op._schema.arguments) if a.alias_info and a.alias_info.is_write]
            if twin is None or written != [0]:
                raise ConversionError(f"in-place op {op} has no functional form")
            src = ins[0]
            written_path = self.path_of(src) if isinstance(src, fx.Node) else None  # a buffer: an output
            if written_path is None and isinstance(src, fx.Node) and src.op == "placeholder":
                raise ConversionError(f"{op} writes to a model input")
            if src in self.aliased:
                raise ConversionError(f"{op} writes to a view, or to a value that has views")
            op, rebind = twin, list(node.inputs())[0]
        if not any(isinstance(x, fx.Node) for x in pytree.tree_leaves(ins)):
            result = self._fold(op, ins)
        else:
            args, kwargs = _split_args(op, ins)
            result = self.call(op, args, kwargs)
            if _returns_alias(op):
                self.aliased.update(x for x in pytree.tree_leaves((ins, result)) if isinstance(x, fx.Node))
        if len(outs) == 1:
            self._set(outs[0], result)
        else:
            for v, x in zip(outs, result):
                self._set(v, x)
        if rebind is not None:
            self._set(rebind, self.env[outs[0].unique()])
        if written_path is not None:
            self.writes[written_path] = self.env[outs[0].unique()]

    def _batch_norm(self, out, x, weight, bias, running_mean, running_var, training, momentum, eps):
        """aten::batch_norm as a functional op; in training its new running stats become writes."""
        if running_mean is None:  # batch statistics, nothing to keep
            op, ins = aten._native_batch_norm_legit.no_stats, [x, weight, bias, training, momentum, eps]
        elif not training:
            op, ins = aten._native_batch_norm_legit_no_training.default, [
                x, weight, bias, running_mean, running_var, momentum, eps]
        else:
            op, ins = aten._native_batch_norm_legit_functional.default, [
                x, weight, bias, running_mean, running_var, True, momentum, eps]
            paths = [self.path_of(running_mean), self.path_of(running_var)]
            if None in paths:
                raise ConversionError("batch_norm updates running stats that are not buffers of the model")
        result = self.call(op, *_split_args(op, ins))
        self._set(out, result[0])
        if op is aten._native_batch_norm_legit_functional.default:
            self.writes.update(zip(paths, result[3:5]))

    def _fold(self, op, ins):
        """All inputs are static: compute now (sizes, scalar arithmetic, tensor constants)."""
        args, kwargs = _split_args(op, ins)
        if "device" in kwargs:
            kwargs["device"] = "cpu"
        return op(*args, **kwargs)


def _returns_alias(op) -> bool:
    """Whether `op`'s result may share memory with an argument in eager PyTorch (a view, `to`, `contiguous`)."""
    return any(r.alias_info is not None for r in op._schema.returns)


def _split_args(op, ins):
    """Positional and keyword arguments as an fx graph has them: defaults left out."""
    args, kwargs = [], {}
    schema_args = op._schema.arguments
    for a, x in zip(schema_args, ins):
        if a.kwarg_only:
            if not _is_default(a, x) and a.name not in ("pin_memory", "layout"):
                kwargs[a.name] = x
        else:
            args.append(x)
    while args and _is_default(schema_args[len(args) - 1], args[-1]):
        args.pop()
    return args, kwargs


def _is_default(arg, value) -> bool:
    if not arg.has_default_value() or isinstance(value, (fx.Node, torch.Tensor)):
        return False
    try:
        return type(value) is type(arg.default_value) and value == arg.default_value
    except Exception:
        return False


class _Module:
    """A submodule reached by prim::GetAttr; `path` is its dotted name."""

    __slots__ = ("path",)

    def __init__(self, path):
        self.path = path


def convert(graph, input_metas, attr_metas, diff_inputs=(), diff_attrs=None) -> Script:
    """Convert an inlined TorchScript graph (of a traced module) to a Script.

    input_metas: [(shape, dtype)] of the graph's inputs after `self`.
    attr_metas: {dotted path: (shape, dtype)} of the module's parameters and buffers.
    diff_inputs: indices of inputs that get gradients; diff_attrs: paths of
    attributes that do (default: all floating-point parameters used).
    Raises ConversionError (or tvm_lowering.LoweringError) when it cannot.
    """
    conv = _Converter(graph, [(tuple(s), d) for s, d in input_metas], attr_metas)
    leaves, spec = conv.run()
    return conv.finish(leaves, spec, attr_metas, diff_inputs, diff_attrs)
