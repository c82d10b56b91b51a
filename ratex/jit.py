"""`ratex.jit.script(model)`: trace the forward once per input signature, differentiate it in TVM.

The returned module behaves like `model` (it shares its parameters, buffers and
submodules, so `state_dict`, `.to()`, `train()`/`eval()` and optimizers built
on `parameters()` all work). On the lazy device a call with inputs of a new
signature (shapes, dtypes, requires_grad, train/eval) traces a CPU copy of the
model with `torch.jit.trace`, converts the TorchScript graph to a Relax
forward (`tvm_lowering.torchscript`), and records each later call as ONE lazy
node `ratex::script_fwd(key, tensors)`; autograd's backward records ONE node
`ratex::script_bwd(key, tensors + grad_outputs)` whose Relax body comes from
`relax.transform.Gradient`. At `mark_step` both are inlined into the step's
program with the loss and optimizer update.

Training-mode state is explicit: each call draws one seed per training dropout
from torch's generator, exactly as the plain lazy path's dropout does, records
the lazy path's own mask ops on it (`random.dropout_keep`; so `torch.manual_seed`
repeats runs, and a scripted model draws the masks the unscripted one would),
and passes the masks as inputs; buffers the forward writes
(BatchNorm's running stats, `num_batches_tracked`) come back as extra outputs
that are copied into the module's buffers.

Models that tracing cannot capture faithfully (the tracer raises, or warns:
data-dependent control flow, `.item()`), or whose graph cannot be converted,
get a warning and run on the plain lazy device, with the same results.
"""
import copy
import hashlib
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from tvm_lowering import LoweringError, torchscript
from .core.tensor import LazyTensor, is_lazy
from .core.tracing import random, registry

__all__ = ["script", "ScriptModule"]

_scripts = {}  # key -> Script (conversion cache: graph text + metas, never the module repr)
_cpu_runners = {}  # key -> _Runner for the CPU kernels (eager fallback)


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
        outs = _cpu_runners[key](args)
    return [o.detach().clone() for o in outs]


@torch.library.impl(_lib, "script_bwd", "CPU")
def _script_bwd_cpu(key, args):
    script = _scripts[key]
    n = len(args) - script.n_outs
    with torch._C._ForceDispatchKeyGuard(*_PLAIN_TLS), torch.enable_grad():
        inputs = [a.detach() for a in args[:n]]
        diff = [inputs[i].requires_grad_(True) for i in script.diff]
        outs = _cpu_runners[key](inputs)[: script.n_outs]
        pairs = [(o, g) for o, g in zip(outs, args[n:]) if o.requires_grad]
        grads = torch.autograd.grad([o for o, _ in pairs], diff, [g for _, g in pairs], allow_unused=True)
    return [torch.zeros_like(d) if g is None else g.detach().clone() for g, d in zip(grads, diff)]


def _call(op, key, tensors: list):
    """`op(key, tensors)`, handed straight to the lazy device's handler where it would end up
    anyway (every tensor lazy, no dispatch mode to see the call): the dispatcher's round trip
    boxes and unboxes both tensor lists on every call."""
    if not torch._C._len_torch_dispatch_stack() and all(type(t) is LazyTensor for t in tensors):
        return registry.dispatch(op, (key, tensors), {})
    return op(key, tensors)


class _Runner:
    """Runs the traced forward on CPU with given inputs, attributes, constants and dropout masks.

    Returns the model's outputs and then the new values of the buffers it writes,
    like the script's Relax forward.
    """

    def __init__(self, cpu_model, script, training):
        self.model, self.script, self.training = cpu_model, script, training

    def __call__(self, args):
        s = self.script
        inputs = args[: s.n_inputs]
        attrs = dict(zip(s.attr_paths, args[s.n_inputs : s.n_inputs + len(s.attr_paths)]))
        for path in s.writes:  # the forward writes these in place; the caller's stay as they are
            attrs[path] = attrs[path].clone()
        masks = args[len(args) - len(s.dropouts) :] if s.dropouts else []
        self.model.train(self.training)
        with _MaskedDropout(masks):
            out = torch.func.functional_call(self.model, attrs, tuple(inputs), tie_weights=False, strict=False)
        return pytree.tree_leaves(out) + [attrs[path] for path in s.writes]


class _MaskedDropout(torch.overrides.TorchFunctionMode):
    """Training dropouts take their keep masks from `masks`, in call order, as the script's do."""

    def __init__(self, masks):
        super().__init__()
        self.masks = iter(masks)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout or func is torch.dropout:
            names = ("input", "p", "training") if func is F.dropout else ("input", "p", "train")
            a = dict(zip(names, args), **kwargs)
            x, p, training = a["input"], a.get("p", 0.5), a.get(names[2], True)
            if training and 0 < p < 1:
                return random.apply_dropout(x, next(self.masks), p)
        return func(*args, **kwargs)


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


# ---- the module wrapper -----------------------------------------------------------
class _Entry:
    """What a signature resolved to: a script key, or None for the plain lazy path."""

    __slots__ = ("key", "script", "consts")

    def __init__(self, key, script, consts):
        self.key, self.script, self.consts = key, script, consts


class ScriptModule(nn.Module):
    """`model` with a compiled, TVM-differentiated forward on the lazy device (see module doc)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        object.__setattr__(self, "_orig", model)
        # Share the model's own dicts: same Parameter objects, same state_dict keys.
        self._parameters = model._parameters
        self._buffers = model._buffers
        self._modules = model._modules
        self._non_persistent_buffers_set = model._non_persistent_buffers_set
        self.training = model.training
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
        if kwargs or not args or not all(isinstance(a, torch.Tensor) for a in args):
            return self._orig(*args, **kwargs)
        if not any(is_lazy(a) for a in args) and not any(is_lazy(t) for _, t in self._attrs()):
            return self._orig(*args)  # scripting only matters on the lazy device
        attrs = dict(self._attrs())
        sig = (
            tuple((tuple(a.shape), a.dtype, a.requires_grad) for a in args),
            tuple((name, tuple(t.shape), t.dtype, t.requires_grad) for name, t in attrs.items()),
            self.training,
        )
        entry = self._entries.get(sig)
        if entry is None:
            entry = self._entries[sig] = self._prepare(args, attrs)
        if entry.key is None:
            return self._orig(*args)
        script = entry.script
        masks = [random.dropout_keep(LazyTensor.from_cpu(random.new_seed(), adopt=True), shape, p)
                 for shape, p in script.dropouts]
        tensors = list(args) + [attrs[p] for p in script.attr_paths] + entry.consts + masks
        if torch.is_grad_enabled() and any(tensors[i].requires_grad for i in script.diff):
            # Autograd keeps the inputs for the backward; the buffers written below must not
            # be among them (their version changes), so the call gets a snapshot of each.
            written = {script.attr_paths.index(p) + script.n_inputs for p in script.writes}
            tensors = [t.detach().clone() if i in written else t for i, t in enumerate(tensors)]
            outs = _ScriptCall.apply(entry.key, *tensors)
        else:
            outs = _call(torch.ops.ratex.script_fwd.default, entry.key, tensors)
        with torch.no_grad():
            for path, new in zip(script.writes, outs[script.n_outs :]):
                attrs[path].copy_(new)
        return pytree.tree_unflatten(list(outs[: script.n_outs]), script.out_spec)

    def _attrs(self):
        """(dotted name, tensor) of every parameter and buffer, tied ones under each name."""
        yield from self._orig.named_parameters(remove_duplicate=False)
        yield from self._orig.named_buffers(remove_duplicate=False)

    def _cpu_model(self):
        if self._cpu is None:
            object.__setattr__(self, "_cpu", _cpu_copy(self._orig))
        return self._cpu

    def _prepare(self, args, attrs) -> _Entry:
        name = type(self._orig).__name__
        try:
            cpu = self._cpu_model()
            cpu.train(self.training)
            # Tracing runs the model (dropout draws random numbers): leave torch's generator
            # where it was, so the seeds drawn per call stay those of the unscripted model.
            with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
                # Shape checks warn too, and shapes are what a trace is specialized on; data
                # reads are caught by _DataReads instead.
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                examples = tuple(_example(a) for a in args)
                with _DataReads(list(examples) + list(cpu.parameters()) + list(cpu.buffers())):
                    traced = torch.jit.trace(cpu, examples, check_trace=False)
            graph = traced.inlined_graph
        except Exception as exc:  # noqa: BLE001  (any tracer failure means: don't script)
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            warnings.warn(
                f"ratex.jit.script: torch.jit.trace cannot capture {name} ({msg}); "
                "running it on the lazy device without scripting",
                stacklevel=3,
            )
            return _Entry(None, None, [])
        diff_inputs = [i for i, a in enumerate(args) if a.requires_grad]
        diff_attrs = {n for n, t in attrs.items() if t.requires_grad}
        input_metas = [(tuple(a.shape), a.dtype) for a in args]
        attr_metas = {n: (tuple(t.shape), t.dtype) for n, t in attrs.items()}
        text = torchscript.graph_text(graph)
        key = "script_" + hashlib.sha1(
            repr((text, input_metas, sorted(attr_metas.items()), diff_inputs, sorted(diff_attrs))).encode()
        ).hexdigest()[:20]
        script = _scripts.get(key)
        if script is None:
            try:
                script = torchscript.convert(graph, input_metas, attr_metas, diff_inputs, diff_attrs)
            except (torchscript.ConversionError, LoweringError) as exc:
                warnings.warn(
                    f"ratex.jit.script: cannot convert {name} to Relax ({exc}); "
                    "running it on the lazy device without scripting",
                    stacklevel=3,
                )
                return _Entry(None, None, [])
            _scripts[key] = script
            torchscript.register(key, script)
            _cpu_runners[key] = _Runner(cpu, script, self.training)
        device = args[0].device
        consts = [c.to(device) for c in script.consts]
        return _Entry(key, script, consts)


class DataDependentError(RuntimeError):
    """The forward reads tensor values into Python (control flow, .item()): a trace would freeze them."""


_T = torch.Tensor
_SHAPE_QUERIES = {
    _T.size, _T.dim, _T.numel, _T.__len__, _T.shape.__get__, _T.ndim.__get__, _T.dtype.__get__,
    _T.device.__get__, _T.is_floating_point, _T.requires_grad.__get__, _T.layout.__get__,
}
_VALUE_READS = {
    _T.__bool__, _T.item, _T.__int__, _T.__float__, _T.__index__, _T.__complex__, _T.tolist, _T.numpy,
}


class _DataReads(torch.overrides.TorchFunctionMode):
    """While tracing: raise where a value computed from inputs/parameters is read into Python.

    Values computed only from shapes (e.g. `key.shape != value.shape` in attention) are fine:
    the trace is specialized on shapes anyway.
    """

    def __init__(self, sources):
        super().__init__()
        self.derived = WeakIdKeyDictionary()
        for t in sources:
            self.derived[t] = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        from_data = any(t in self.derived for t in tensors)
        if from_data and func in _VALUE_READS:
            name = getattr(func, "__name__", str(func))
            raise DataDependentError(
                f"its forward reads tensor values into Python ({name}), e.g. data-dependent control flow"
            )
        out = func(*args, **kwargs)
        if from_data and func not in _SHAPE_QUERIES:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.derived[t] = True
        return out


def _example(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of t's shape and dtype; values don't matter (data-dependence warns)."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return torch.randn(t.shape, dtype=t.dtype)
    return torch.zeros(t.shape, dtype=t.dtype)


def _cpu_copy(model: nn.Module) -> nn.Module:
    """A CPU copy of `model`'s structure and current values, detached from its parameters."""
    def cpu(t):
        # Tracing doesn't read values (data-dependence warns), and the CPU kernels get
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


def script(model: nn.Module) -> ScriptModule:
    """Return `model` with its forward traced, converted to Relax and differentiated by TVM."""
    if isinstance(model, ScriptModule):
        return model
    if not isinstance(model, nn.Module):
        raise TypeError(f"ratex.jit.script expects an nn.Module, got {type(model).__name__}")
    return ScriptModule(model)
