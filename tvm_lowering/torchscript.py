"""TorchScript graph -> torch.fx.Graph of ATen OpOverloads -> Relax `fwd`; Relax Gradient -> `bwd`.

The TorchScript path shares the lazy path's lowering table: each `aten::name`
node becomes a call of the OpOverload its schema names (`aten::conv2d` ->
`torch.ops.aten.conv2d.default`), with `meta["val"]` from running the op on
meta tensors, and `import_graph` lowers the fx graph with the same rules.

`convert` returns a `Script`: the Relax forward
`fwd(inputs..., attrs..., consts..., masks...) -> (outputs..., new buffers...)`,
the output metas and structure, and, built on first use, the backward
`bwd(inputs..., attrs..., consts..., masks..., grad_outputs...) -> (loss, (grads...))`
that `relax.transform.Gradient` derives from `fwd`.

Indices are checked as in every program (ops/bounds.py): where the forward indexes with
tensors, its last output holds the check rows, `Script.checks` their headers and
`Script.sites` the TorchScript op and source range of each checked site.

State that a training-mode forward changes becomes explicit: each training
dropout takes its bool keep mask as an input (`Script.dropouts` says its shape
and p). The caller draws it from a fresh seed with the lazy path's own
dropout ops (`ratex.core.random.dropout_keep`), so a scripted model draws the
masks the unscripted one does, the backward applies the same mask, and the
random bits stay outside the differentiated function (their rule is a
call_tir, which Gradient refuses). Buffers written in place (BatchNorm's
running stats and `num_batches_tracked`) are returned as extra outputs after
the model's own, for the caller to write back. Scripts are registered by
key (`register`, from ops/script.py) so the `script_fwd`/`script_bwd` lowering
rules can find them. Only metas cross into this module, never tensor data, except
tensor constants baked into a trace, which become extra `consts` inputs.
"""
import operator
import re
import threading

import torch
from torch import fx
from torch.utils import _pytree as pytree
import tvm
from tvm import relax

from . import autodiff
from .importer import import_graph
from .ops.bounds import SITE
from .ops.script import register  # noqa: F401  (ratex.jit registers each converted script through here)

aten = torch.ops.aten


class ConversionError(RuntimeError):
    """The TorchScript graph uses something the converter cannot express."""


class Script:
    """A converted forward, its metas, and its (lazily built) backward."""

    def __init__(self, fwd, n_inputs, attr_paths, consts, dropouts, out_metas, out_spec, writes, diff, checks=(),
                 sites=None):
        self.fwd = fwd  # relax.Function
        self.n_inputs = n_inputs
        self.attr_paths = attr_paths  # module attribute path of each attr input, in order
        self.consts = consts  # CPU tensors baked into the trace, passed after the attrs
        self.dropouts = dropouts  # [(shape, p)] of the training dropouts, whose keep masks are the last inputs
        self.out_metas = out_metas  # [(shape, dtype)] of the flat outputs, new buffers included
        self.out_spec = out_spec  # pytree spec rebuilding the model's output structure
        self.writes = writes  # attr paths of the buffers the forward writes: the last outputs
        self.n_outs = len(out_metas) - len(writes)  # the model's own outputs
        self.diff = diff  # indices (into inputs+attrs+consts) that get gradients
        self.checks = list(checks)  # headers of the index checks in fwd's last output (ops/bounds.py)
        self.sites = sites or {}  # site of a check -> (TorchScript op, its source range)
        self._bwd = None
        self._lock = threading.Lock()

    @property
    def bwd(self):
        """relax.Function: (inputs..., attrs..., consts..., masks..., grad_outs...) -> (loss, (grads...)).

        grad_outs are those of the model's own outputs; new buffer values get none.
        """
        with self._lock:
            if self._bwd is None:
                self._bwd = autodiff.vjp(self.fwd, self.diff, self.n_outs)
            return self._bwd


def graph_text(graph) -> str:
    """The TorchScript graph's text without source-location comments (a stable cache key)."""
    text = re.sub(r"\s*#[^\n]*", "", str(graph))
    return re.sub(r"___torch_mangle_\d+\.", "", text)  # each re-trace renames the module types


# ---- TorchScript -> fx ------------------------------------------------------------
_FOLDABLE = ("aten::size", "aten::Int", "aten::Float", "aten::ScalarImplicit", "prim::NumToTensor")


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


_DROPOUTS = {
    aten.dropout.default, aten.dropout_.default, aten.feature_dropout.default, aten.alpha_dropout.default,
    aten.feature_alpha_dropout.default,
}
_MASKED_DROPOUTS = {aten.dropout.default, aten.dropout_.default}  # native_dropout's elementwise masks


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


class _Converter:
    def __init__(self, graph, input_metas, attr_metas):
        self.ts = graph
        self.g = fx.Graph()
        self.env = {}  # TorchScript value unique id -> python value / fx.Node / _Module / CPU tensor
        self.last_ph = None
        self.attr_metas = attr_metas
        self.attr_paths, self.attr_nodes = [], {}
        self.consts, self.const_nodes = [], {}
        self.masks, self.dropouts = [], []  # keep-mask placeholders; (shape, p) of each
        self.writes = {}  # attr path -> fx node of the value the forward wrote there
        self.ts_node, self.origins = None, []  # the TorchScript node being converted; that of each fx call
        ts_inputs = list(graph.inputs())
        if len(ts_inputs) != len(input_metas) + 1:
            raise ConversionError(f"graph takes {len(ts_inputs) - 1} inputs, {len(input_metas)} given")
        self.env[ts_inputs[0].unique()] = _Module("")
        for i, (v, (shape, dtype)) in enumerate(zip(ts_inputs[1:], input_metas)):
            self.env[v.unique()] = self._placeholder(f"in{i}", torch.empty(shape, dtype=dtype, device="meta"))
        self.n_inputs = len(input_metas)

    def _placeholder(self, name, val):
        if self.last_ph is not None:
            ctx = self.g.inserting_after(self.last_ph)  # placeholders stay in front, in creation order
        else:
            ctx = self.g.inserting_before(next(iter(self.g.nodes), None))
        with ctx:
            p = self.g.placeholder(name)
        p.meta["val"] = val
        self.last_ph = p
        return p

    def _attr(self, path):
        if path in self.writes:  # read after an in-place write: the written value
            return self.writes[path]
        node = self.attr_nodes.get(path)
        if node is None:
            meta = self.attr_metas.get(path)
            if meta is None:
                raise ConversionError(f"module attribute {path!r} is not a parameter or buffer")
            shape, dtype = meta
            node = self._placeholder(f"attr{len(self.attr_paths)}", torch.empty(shape, dtype=dtype, device="meta"))
            self.attr_paths.append(path)
            self.attr_nodes[path] = node
        return node

    def _const_input(self, t):
        node = self.const_nodes.get(id(t))
        if node is None:
            meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
            node = self._placeholder(f"const{len(self.consts)}", meta)
            self.consts.append(t)
            self.const_nodes[id(t)] = node
        return node

    def _dropout(self, x, p):
        """x * keep * (1 / (1 - p)) with `keep` a new bool input: ratex.core.random.apply_dropout's ops."""
        if isinstance(x, torch.Tensor):  # a constant baked into the trace
            x = self._const_input(x)
        shape = tuple(x.meta["val"].shape)
        keep = self._placeholder(f"mask{len(self.masks)}", torch.empty(shape, dtype=torch.bool, device="meta"))
        self.masks.append(keep)
        self.dropouts.append((shape, p))
        return self._call(aten.mul.Tensor, [self._call(aten.mul.Tensor, [x, keep]), 1.0 / (1.0 - p)])

    def _path_of(self, x):
        """The attr path whose current value is fx node `x` (None: not a parameter or buffer)."""
        for path, node in list(self.writes.items()) + list(self.attr_nodes.items()):
            if node is x:
                return path
        return None

    def _order_placeholders(self):
        """Parameters in the order Script promises: inputs, attrs, consts, masks."""
        phs = [n for n in self.g.nodes if n.op == "placeholder"]
        order = phs[: self.n_inputs] + [self.attr_nodes[p] for p in self.attr_paths]
        order += [self.const_nodes[id(t)] for t in self.consts] + self.masks
        anchor = next(n for n in self.g.nodes if n.op != "placeholder")
        for n in order:
            anchor.prepend(n)

    def run(self):
        for node in self.ts.nodes():
            self._node(node)
        outs = [self.env[v.unique()] for v in self.ts.outputs()]
        result = outs[0] if len(outs) == 1 else tuple(outs)
        leaves, spec = pytree.tree_flatten(result)
        fx_leaves = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                leaf = self._const_input(leaf)
            if not isinstance(leaf, fx.Node):
                raise ConversionError(f"the model returns a non-tensor ({type(leaf).__name__})")
            fx_leaves.append(leaf)
        fx_leaves += list(self.writes.values())
        self.g.output(tuple(fx_leaves))
        self._order_placeholders()
        metas = [(tuple(n.meta["val"].shape), n.meta["val"].dtype) for n in fx_leaves]
        return metas, spec

    # ---- one TorchScript node ------------------------------------------------
    def _node(self, node):
        self.ts_node = node
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
        if op in _DROPOUTS:
            if ins[1] == 0 or not ins[2]:  # p == 0 or eval mode: identity
                self._set(outs[0], ins[0])
                return
            if op not in _MASKED_DROPOUTS or not 0 < ins[1] < 1:
                raise ConversionError(f"{op} with p={ins[1]} in training mode")
            out = self._dropout(ins[0], float(ins[1]))
            self._set(outs[0], out)
            if op is aten.dropout_.default:  # later reads of the input see the dropped-out value
                self._set(list(node.inputs())[0], out)
            return
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
            written_path = self._path_of(src) if isinstance(src, fx.Node) else None  # a buffer: an output
            if written_path is None and isinstance(src, fx.Node) and src.op == "placeholder":
                raise ConversionError(f"{op} writes to a model input")
            op, rebind = twin, list(node.inputs())[0]
        if not any(isinstance(x, fx.Node) for x in pytree.tree_leaves(ins)):
            result = self._fold(op, ins)
        else:
            result = self._call(op, ins)
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
            paths = [self._path_of(running_mean), self._path_of(running_var)]
            if None in paths:
                raise ConversionError("batch_norm updates running stats that are not buffers of the model")
        result = self._call(op, ins)
        self._set(out, result[0])
        if op is aten._native_batch_norm_legit_functional.default:
            self.writes.update(zip(paths, result[3:5]))

    def _split_args(self, op, ins):
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

    def _fold(self, op, ins):
        """All inputs are static: compute now (sizes, scalar arithmetic, tensor constants)."""
        args, kwargs = self._split_args(op, ins)
        if "device" in kwargs:
            kwargs["device"] = "cpu"
        return op(*args, **kwargs)

    def _call(self, op, ins):
        ins = pytree.tree_map(lambda x: self._const_input(x) if isinstance(x, torch.Tensor) else x, ins)
        args, kwargs = self._split_args(op, ins)
        if op is aten.size.int:  # static shapes: a size is a constant
            return int(args[0].meta["val"].shape[args[1]])
        if op is aten.size.default:
            return [int(s) for s in args[0].meta["val"].shape]
        if "device" in kwargs:
            kwargs["device"] = None
        meta_args, meta_kwargs = pytree.tree_map(
            lambda x: x.meta["val"] if isinstance(x, fx.Node) else x, (args, kwargs)
        )
        names = [a.name for a in op._schema.arguments]
        if "device" in names:  # positional in to.device, keyword-only in the factories
            where = names.index("device")
            if where < len(meta_args):
                meta_args[where] = "meta"
            else:
                meta_kwargs["device"] = "meta"
        try:
            val = op(*meta_args, **meta_kwargs)
        except Exception as exc:
            raise ConversionError(f"{op}: {exc}") from exc
        call = self.g.call_function(op, tuple(args), kwargs)
        call.meta[SITE] = len(self.origins)
        self.origins.append(self.ts_node)
        if isinstance(val, torch.Tensor):
            call.meta["val"] = val
            return call
        if isinstance(val, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in val):
            call.meta["val"] = tuple(val)
            items = []
            for i, v in enumerate(val):
                item = self.g.call_function(operator.getitem, (call, i))
                item.meta["val"] = v
                items.append(item)
            return items if isinstance(val, list) or op._schema.returns[0].type.kind() == "ListType" else tuple(items)
        raise ConversionError(f"{op} returns {type(val).__name__}")


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


def _tir_kernels(fn) -> list:
    """Names of the PrimFuncs that Relax function `fn` calls with call_tir."""
    call_tir = tvm.ir.Op.get("relax.call_tir")
    names = []

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op.same_as(call_tir):
            names.append(expr.args[0].name_hint)

    relax.analysis.post_order_visit(fn.body, visit)
    return sorted(set(names))


def convert(graph, input_metas, attr_metas, diff_inputs=(), diff_attrs=None) -> Script:
    """Convert an inlined TorchScript graph (of a traced module) to a Script.

    input_metas: [(shape, dtype)] of the graph's inputs after `self`.
    attr_metas: {dotted path: (shape, dtype)} of the module's parameters and buffers.
    diff_inputs: indices of inputs that get gradients; diff_attrs: paths of
    attributes that do (default: all floating-point parameters used).
    Raises ConversionError (or tvm_lowering.LoweringError) when it cannot.
    """
    conv = _Converter(graph, [(tuple(s), d) for s, d in input_metas], attr_metas)
    out_metas, out_spec = conv.run()
    fxg = conv.g
    fxg.lint()
    checks = []
    mod = import_graph(fxg, name="fwd", differentiable=True, checks=checks)
    fwd = mod["fwd"]
    kernels = _tir_kernels(fwd)
    if kernels:  # neither differentiable nor callable once fwd is inlined without the module's PrimFuncs
        raise ConversionError(f"a rule emitted TIR kernels {kernels} where Relax ops are needed")
    sites = {site: (conv.origins[site].kind(), conv.origins[site].sourceRange())
             for site, *_ in checks if 0 <= site < len(conv.origins)}
    n_in = conv.n_inputs
    diff = [i for i in diff_inputs if input_metas[i][1].is_floating_point]
    for j, path in enumerate(conv.attr_paths):
        if (diff_attrs is None or path in diff_attrs) and attr_metas[path][1].is_floating_point:
            diff.append(n_in + j)
    return Script(fwd, n_in, list(conv.attr_paths), list(conv.consts), list(conv.dropouts), out_metas, out_spec,
                  list(conv.writes), diff, checks, sites)
