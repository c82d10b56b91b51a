"""`ratex.jit.script(model)`: capture the forward once per call signature, differentiate it in TVM.

The returned module behaves like `model` (it shares its parameters, buffers and
submodules, so `state_dict`, `.to()`, `train()`/`eval()` and optimizers built
on `parameters()` all work). On the lazy device a call of a new signature (which
arguments and keywords were given, their tensors' shapes, dtypes and
requires_grad, the other arguments' values, train/eval) captures a CPU copy of
the model (ratex/capture.py: TorchScript's trace, else torch.export), converts
the graph to a Relax forward (`tvm_lowering.torchscript`, `tvm_lowering.exported`),
and records each call as ONE lazy node `ratex::script_fwd(key, tensors)`;
autograd's backward records ONE node `ratex::script_bwd(key, tensors + grad_outputs)`
whose Relax body comes from `relax.transform.Gradient`. At `mark_step` both are
inlined into the step's program with the loss and optimizer update. The outputs
come back in the structure the model returns (tuples, dicts, Hugging Face's
ModelOutput and caches).

Training-mode state is explicit: each call draws one seed per training dropout
from torch's generator, exactly as the plain lazy path's dropout does, records
the lazy path's own mask ops on it (`random.dropout_keep`; so `torch.manual_seed`
repeats runs, and a scripted model draws the masks the unscripted one would),
and passes the masks as inputs; buffers the forward writes
(BatchNorm's running stats, `num_batches_tracked`) come back as extra outputs
that are copied into the module's buffers.

Models that neither capture takes faithfully (data-dependent control flow,
`.item()`), or whose graph cannot be converted, get a warning and run on the
plain lazy device, with the same results.

On the plain lazy device too, each LSTM/GRU/RNN call is one script node (see
"RNNs on the plain lazy device" below).
"""
import copy
import hashlib
import inspect
import warnings

import torch
import torch.nn.functional as F
from torch import fx, nn

from tvm_lowering import LoweringError, exported, torchscript
from tvm_lowering.scriptgraph import Builder, ConversionError
from . import capture
from .core.tensor import LazyTensor, is_lazy
from .core.tracing import random, registry

__all__ = ["script", "ScriptModule", "CAPTURES"]

# The captures `script` tries, in order. TorchScript's trace captures a small model in a
# fraction of export's time (and export's first use in a process imports its machinery);
# export takes what a trace cannot: writes through views, and graphs the converter refuses.
CAPTURES = ("trace", "export")

_scripts = {}  # key -> Script (conversion cache: graph text + metas, never the module repr)
_cpu_runners = {}  # key -> fx.GraphModule computing the script's forward with ATen's CPU kernels


# ---- the two custom ops -------------------------------------------------------------
_lib = torch.library.Library("ratex", "FRAGMENT")
_lib.define("script_fwd(str key, Tensor[] args) -> Tensor[]")
_lib.define("script_bwd(str key, Tensor[] args) -> Tensor[]")


def _empty(args, metas):
    device = args[0].device if args else "meta"
    return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in metas]


@torch.library.register_fake("ratex::script_fwd", lib=_lib)
def _script_fwd_fake(key, args):
    return _empty(args, _scripts[key].out_metas)


@torch.library.register_fake("ratex::script_bwd", lib=_lib)
def _script_bwd_fake(key, args):
    script = _scripts[key]
    return _empty(args, [(tuple(args[i].shape), args[i].dtype) for i in script.diff])


# The CPU kernels run plain PyTorch, autograd included. Called from inside the lazy
# device's __torch_dispatch__ (the eager fallback), the dispatcher's thread-local state
# excludes autograd and the other keys above Python; restore the state of a fresh thread.
_PLAIN_TLS = (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())


@torch.library.impl(_lib, "script_fwd", "CPU")
def _script_fwd_cpu(key, args):
    with torch._C._ForceDispatchKeyGuard(*_PLAIN_TLS), torch.no_grad():
        outs = _cpu_runners[key](*args)
    return [o.detach().clone() for o in outs]


@torch.library.impl(_lib, "script_bwd", "CPU")
def _script_bwd_cpu(key, args):
    script = _scripts[key]
    n = len(args) - script.n_outs
    with torch._C._ForceDispatchKeyGuard(*_PLAIN_TLS), torch.enable_grad():
        inputs = [a.detach() for a in args[:n]]
        diff = [inputs[i].requires_grad_(True) for i in script.diff]
        outs = _cpu_runners[key](*inputs)[: script.n_outs]
        pairs = [(o, g) for o, g in zip(outs, args[n:]) if o.requires_grad]
        grads = torch.autograd.grad([o for o, _ in pairs], diff, [g for _, g in pairs], allow_unused=True)
    return [torch.zeros_like(d) if g is None else g.detach().clone() for g, d in zip(grads, diff)]


def register(key: str, script):
    """Make `script` (a tvm_lowering Script) callable as `key` by script_fwd/script_bwd: its Relax
    functions for the lowering rules, its fx graph as the CPU kernels."""
    _scripts[key] = script
    torchscript.register(key, script)
    _cpu_runners[key] = fx.GraphModule(nn.Module(), _reshaping(script.graph))


def _reshaping(graph: fx.Graph) -> fx.Graph:
    """A copy of `graph` whose views are reshapes: its values have the layouts of ATen's CPU
    kernels, not the captured model's (a transposed attention output that the model made
    contiguous before its view), and a view is only its shape here, as in Relax."""
    copy_ = fx.Graph()
    copy_.output(copy_.graph_copy(graph, {}))
    for node in copy_.nodes:
        if node.op == "call_function" and node.target in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default):
            node.target = torch.ops.aten.reshape.default
    return copy_


def _call(op, key, tensors: list):
    """`op(key, tensors)`, handed straight to the lazy device's handler where it would end up
    anyway (every tensor lazy, no dispatch mode to see the call): the dispatcher's round trip
    boxes and unboxes both tensor lists on every call."""
    if not torch._C._len_torch_dispatch_stack() and all(type(t) is LazyTensor for t in tensors):
        return registry.dispatch(op, (key, tensors), {})
    return op(key, tensors)


class _ScriptCall(torch.autograd.Function):
    """Autograd node of one script call: forward is script_fwd, backward is script_bwd."""

    @staticmethod
    def forward(ctx, key, *tensors):
        outs = _call(torch.ops.ratex.script_fwd.default, key, list(tensors))
        n_outs = _scripts[key].n_outs
        ctx.key = key
        ctx.save_for_backward(*tensors)
        ctx.mark_non_differentiable(*[o for i, o in enumerate(outs) if i >= n_outs or not o.dtype.is_floating_point])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        script = _scripts[ctx.key]
        tensors = list(ctx.saved_tensors)
        grads = _call(torch.ops.ratex.script_bwd.default, ctx.key, tensors + list(grad_outs[: script.n_outs]))
        result = [None] * (len(tensors) + 1)
        for i, g in zip(script.diff, grads):
            if ctx.needs_input_grad[i + 1]:
                result[i + 1] = g
        return tuple(result)


def call_script(key: str, tensors: list) -> list:
    """The outputs of script `key` on `tensors` (lazy), recorded as one script_fwd node, and its
    gradient as one script_bwd node where autograd will ask for one."""
    script = _scripts[key]
    if torch.is_grad_enabled() and any(tensors[i].requires_grad for i in script.diff):
        return list(_ScriptCall.apply(key, *tensors))
    return _call(torch.ops.ratex.script_fwd.default, key, tensors)


def script_key(*parts) -> str:
    """A script key: a hash of everything that decides the converted script."""
    return "script_" + hashlib.sha1(repr(parts).encode()).hexdigest()[:20]


# ---- RNNs on the plain lazy device ----------------------------------------------------
# aten::lstm and its kin are composite: on the lazy device each call would record the
# per-step, per-gate ATen ops of PyTorch's decomposition, and their backward op by op.
# Above autograd, for lazy tensors, each call is instead one script call of the RNN alone,
# unrolled by scriptgraph's Builder: one script_fwd node, one script_bwd node.
_RNN_OPS = (torch.ops.aten.lstm.input, torch.ops.aten.gru.input, torch.ops.aten.rnn_tanh.input,
            torch.ops.aten.rnn_relu.input)
_rnn_lib = torch.library.Library("aten", "IMPL")


_rnn_refused = {}  # key -> why the RNN could not be converted (it then records PyTorch's decomposition)


def _rnn_script(op, hx, params, flags, tensors):
    """The key of the script computing `op` on these tensors' metas and flags (built on first
    use), or None where it cannot be converted."""
    metas = [(tuple(t.shape), t.dtype, t.requires_grad) for t in tensors]
    key = script_key("rnn", str(op), metas, flags)
    if key in _rnn_refused:
        return None
    if key not in _scripts:
        b = Builder()
        nodes = [b.input(shape, dtype) for shape, dtype, _ in metas]
        it = iter(nodes)
        args = [next(it), [next(it) for _ in hx], [next(it) for _ in params], *flags]
        if op is not torch.ops.aten.lstm.input:
            args[1] = args[1][0]
        diff = [i for i, (_, _, grad) in enumerate(metas) if grad]
        try:
            script = b.finish(list(b.call(op, args, {})), None, {}, diff)
        except (ConversionError, LoweringError) as exc:
            _rnn_refused[key] = str(exc)
            return None
        register(key, script)
    return key


def _rnn_impl(op):
    def impl(x, hx, params, *flags):
        hx = list(hx) if isinstance(hx, (list, tuple)) else [hx]
        tensors = [x, *hx, *params]
        # Fake tensors of a lazy device (torch.compile), RNNs the Builder refuses (proj_size) and
        # calls under ratex.amp.autocast (whose casts apply to the decomposition's products)
        # take PyTorch's decomposition.
        lazy = all(type(t) is LazyTensor for t in tensors) and not torch._C._dispatch_tls_is_dispatch_key_included(
            torch._C.DispatchKey.AutocastPrivateUse1)
        key = _rnn_script(op, hx, params, tuple(flags), tensors) if lazy else None
        if key is None:
            return op.decompose(x, hx if op is torch.ops.aten.lstm.input else hx[0], params, *flags)
        masks = [random.dropout_keep(LazyTensor.from_cpu(random.new_seed(), adopt=True), shape, p)
                 for shape, p in _scripts[key].dropouts]
        return tuple(call_script(key, tensors + masks))
    return impl


for _op in _RNN_OPS:
    _rnn_lib.impl(_op._schema.name.split("::")[1] + "." + _op._overloadname, _rnn_impl(_op), "AutogradLazy")


# ---- the module wrapper -----------------------------------------------------------
class _Entry:
    """What a signature resolved to: a script key and how to call it, or key None for the plain lazy path.

    `capture` names the capture that took it ("trace", "export"; None: the plain lazy path)."""

    __slots__ = ("key", "script", "consts", "outputs", "capture")

    def __init__(self, key=None, script=None, consts=(), outputs=None, capture=None):
        self.key, self.script, self.consts, self.outputs = key, script, list(consts), outputs
        self.capture = capture


class ScriptModule(nn.Module):
    """`model` with a compiled, TVM-differentiated forward on the lazy device (see module doc)."""

    def __init__(self, model: nn.Module, captures=CAPTURES):
        super().__init__()
        object.__setattr__(self, "_orig", model)
        capture.share(self, model)
        object.__setattr__(self, "_captures", tuple(captures))
        object.__setattr__(self, "_signature", None)
        object.__setattr__(self, "_cpu", None)
        object.__setattr__(self, "_entries", {})

    @property
    def original_module(self) -> nn.Module:
        """The wrapped model."""
        return self._orig

    def train(self, mode: bool = True):
        self._orig.train(mode)
        self.training = mode
        return self

    def extra_repr(self):
        return f"script of {type(self._orig).__name__}"

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._orig, name)

    def forward(self, *args, **kwargs):
        if args and not kwargs and all(isinstance(a, torch.Tensor) for a in args):
            tensors, call = args, len(args)  # the common call: its key is its arity
        else:
            call = capture.Call.bind(self._sig(), args, kwargs)
            if call is None or not call.tensors:
                return self._orig(*args, **kwargs)
            tensors = call.tensors
        if not all(is_lazy(t) for t in tensors):  # scripting only matters on the lazy device
            return self._orig(*args, **kwargs)
        attrs = dict(self._attrs())
        sig = (
            call if type(call) is int else call.key,
            tuple((tuple(a.shape), a.dtype, a.requires_grad) for a in tensors),
            tuple((name, tuple(t.shape), t.dtype, t.requires_grad) for name, t in attrs.items()),
            self.training,
        )
        entry = self._entries.get(sig)
        if entry is None:
            if type(call) is int:
                call = capture.Call.bind(self._sig(), args, kwargs)
            entry = self._entries[sig] = self._prepare(call, attrs)
        if entry.key is None:
            return self._orig(*args, **kwargs)
        script = entry.script
        masks = [random.dropout_keep(LazyTensor.from_cpu(random.new_seed(), adopt=True), shape, p)
                 for shape, p in script.dropouts]
        tensors = list(tensors) + [attrs[p] for p in script.attr_paths] + entry.consts + masks
        if torch.is_grad_enabled() and any(tensors[i].requires_grad for i in script.diff):
            # Autograd keeps the inputs for the backward; the buffers written below must not
            # be among them (their version changes), so the call gets a snapshot of each.
            written = {script.attr_paths.index(p) + script.n_inputs for p in script.writes}
            tensors = [t.detach().clone() if i in written else t for i, t in enumerate(tensors)]
        outs = call_script(entry.key, tensors)
        with torch.no_grad():
            for path, new in zip(script.writes, outs[script.n_outs :]):
                attrs[path].copy_(new)
        return entry.outputs.rebuild(list(outs[: script.n_outs]))

    def _sig(self) -> inspect.Signature:
        if self._signature is None:
            object.__setattr__(self, "_signature", inspect.signature(self._orig.forward))
        return self._signature

    def _attrs(self):
        """(dotted name, tensor) of every parameter and buffer, tied ones under each name."""
        yield from self._orig.named_parameters(remove_duplicate=False)
        yield from self._orig.named_buffers(remove_duplicate=False)

    def _cpu_model(self):
        if self._cpu is None:
            object.__setattr__(self, "_cpu", _cpu_copy(self._orig))
        return self._cpu

    def _prepare(self, call, attrs) -> _Entry:
        name = type(self._orig).__name__
        if call is None:
            return _Entry()  # the arguments don't fit forward: let the model say so
        input_metas = [(tuple(t.shape), t.dtype) for t in call.tensors]
        attr_metas = {n: (tuple(t.shape), t.dtype) for n, t in attrs.items()}
        diff_inputs = [i for i, t in enumerate(call.tensors) if t.requires_grad]
        diff_attrs = {n for n, t in attrs.items() if t.requires_grad}
        failures = []
        for how in self._captures:
            try:
                cpu = self._cpu_model()
                cpu.train(self.training)
                flat = capture.Flat(cpu, call)
                if how == "trace":
                    graph = capture.trace(flat, input_metas)
                    text = torchscript.graph_text(graph)
                else:
                    graph = capture.export(flat, input_metas)
                    text = exported.graph_text(graph)
            except Exception as exc:  # noqa: BLE001  (any capture failure means: try the next)
                failures.append(f"{_CAPTURE_NAMES[how]}: {_first_line(exc)}")
                continue
            key = script_key(how, text, input_metas, sorted(attr_metas.items()), diff_inputs, sorted(diff_attrs))
            script = _scripts.get(key)
            if script is None:
                try:
                    if how == "trace":
                        script = torchscript.convert(graph, input_metas, attr_metas, diff_inputs, diff_attrs)
                    else:
                        script = exported.convert(graph, attr_metas, diff_inputs, diff_attrs)
                except (ConversionError, LoweringError) as exc:
                    failures.append(f"{_CAPTURE_NAMES[how]}: cannot convert to Relax: {_first_line(exc)}")
                    continue
                register(key, script)
            device = call.tensors[0].device
            return _Entry(key, script, [c.to(device) for c in script.consts], flat.outputs, how)
        warnings.warn(
            f"ratex.jit.script: cannot capture {name} ({'; '.join(failures)}); "
            "running it on the lazy device without scripting",
            stacklevel=3,
        )
        return _Entry()


_CAPTURE_NAMES = {"trace": "torch.jit.trace", "export": "torch.export"}


def _first_line(exc) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line if len(line) <= 300 else line[:297] + "..."


def _cpu_copy(model: nn.Module) -> nn.Module:
    """A CPU copy of `model`'s structure and current values, detached from its parameters."""
    def cpu(t):
        # Capturing doesn't read values (a read refuses the capture), and the CPU kernels get
        # the current values as arguments: lazy tensors aren't synced just to copy them.
        return torch.zeros(t.shape, dtype=t.dtype) if is_lazy(t) else t.detach().clone()

    memo = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(cpu(p), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = cpu(b)
    copied = copy.deepcopy(model, memo)
    for m in copied.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.momentum is None and m.track_running_stats:
            m.forward = _CumulativeBatchNorm(m)
    return copied


class _CumulativeBatchNorm:
    """BatchNorm(momentum=None)'s forward as tensor ops, so that it traces.

    PyTorch reads `1 / num_batches_tracked` into a Python float (a trace would freeze
    it); here the factor stays a tensor and the running stats are updated with
    in-place ops, which the converter turns into buffer writes. Same formulas as
    PyTorch's kernel: stat = (1 - f) * stat + f * batch stat, unbiased variance.
    """

    def __init__(self, bn):
        self.bn = bn

    def __call__(self, x):
        bn = self.bn
        if not bn.training:
            return type(bn).forward(bn, x)
        bn._check_input_dim(x)
        bn.num_batches_tracked.add_(1)
        out = F.batch_norm(x, None, None, bn.weight, bn.bias, True, 0.0, bn.eps)
        with torch.no_grad():
            dims = [0] + list(range(2, x.dim()))
            mean, var = x.mean(dims), x.var(dims, correction=1)
            f = bn.num_batches_tracked.to(bn.running_mean.dtype).reciprocal()
            bn.running_mean.mul_(1.0 - f).add_(mean * f)
            bn.running_var.mul_(1.0 - f).add_(var * f)
        return out


def script(model: nn.Module, captures=CAPTURES) -> ScriptModule:
    """Return `model` with its forward captured, converted to Relax and differentiated by TVM.

    `captures` names the captures to try, in order: "trace" (TorchScript) and "export"
    (torch.export); the default tries both.
    """
    if isinstance(model, ScriptModule):
        return model
    if not isinstance(model, nn.Module):
        raise TypeError(f"ratex.jit.script expects an nn.Module, got {type(model).__name__}")
    captures = tuple(captures)
    unknown = [c for c in captures if c not in _CAPTURE_NAMES]
    if unknown or not captures:
        raise ValueError(f"ratex.jit.script: captures must name some of {sorted(_CAPTURE_NAMES)}, got {captures!r}")
    return ScriptModule(model, captures)
