"""How `ratex.jit.script` captures a forward: the call, the outputs, and the two captures.

- `Call`: one call's arguments bound to `forward`'s signature. The tensors among them, in
  signature order, are the script's inputs; the rest (which keywords were given, None,
  bools, ints, strings) is part of the call's `key`, since a trace freezes them.
- `Outputs`: the structure of what the forward returned (tuples, dicts, dataclasses such
  as Hugging Face's `ModelOutput`, objects holding tensors such as its `DynamicCache`),
  flattened to its tensors and rebuilt around new ones.
- `Flat`: a module sharing a model's parameters, buffers and submodules (so their dotted
  names are the model's), whose forward takes the call's tensors positionally and
  returns the output's tensors as a tuple. Both captures capture a `Flat`.
- `trace`: TorchScript's `torch.jit.trace`, with values read into Python refused
  (`DataReads`), since a trace would freeze them. Fast, but deprecated in torch and
  blind to aliasing, which its converter refuses where it could matter.
- `export`: `torch.export.export(strict=False)` then `run_decompositions({})`: functional
  ATen with views and in-place writes resolved; it refuses data-dependent Python itself.

Both run on a CPU copy of the model, leave torch's generator where it was, and keep
their warnings and log lines (deprecations, shape checks) from the user's terminal.
"""
import contextlib
import copy
import inspect
import logging
import types
import warnings

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["Call", "Outputs", "Flat", "share", "trace", "export", "DataDependentError"]

_TENSOR = object()  # a tensor's place among a call's arguments
_SCALARS = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.memory_format, torch.layout)


class Call:
    """A call's arguments: `tensors` (the script's inputs), `key` (the rest), and `rebuild`."""

    __slots__ = ("tensors", "key", "_sig", "_spec", "_leaves")  # _leaves: plain values, _TENSOR for tensors

    def __init__(self, tensors, key, sig, spec, leaves):
        self.tensors, self.key, self._sig, self._spec, self._leaves = tensors, key, sig, spec, leaves

    @classmethod
    def bind(cls, sig: inspect.Signature, args, kwargs):
        """The Call of `forward(*args, **kwargs)` for `forward`'s signature `sig`; None where it
        cannot be scripted (the arguments don't fit the signature, or hold objects other than
        tensors, containers and plain values)."""
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError:
            return None  # the model's own call raises the right error
        leaves, spec = pytree.tree_flatten(dict(bound.arguments))
        tensors, rest = [], []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                tensors.append(leaf)
                rest.append(_TENSOR)
            elif isinstance(leaf, _SCALARS):
                rest.append((type(leaf), leaf))
            else:
                return None
        rest = tuple(rest)
        return cls(tensors, (spec, rest), sig, spec, [x if x is _TENSOR else x[1] for x in rest])

    def without_tensors(self) -> "Call":
        """This call with no tensors held: what `rebuild` needs, for whatever outlives the call."""
        return Call([], self.key, self._sig, self._spec, self._leaves)

    def rebuild(self, tensors):
        """(args, kwargs) of this call with `tensors` in place of its tensors."""
        it = iter(tensors)
        leaves = [next(it) if x is _TENSOR else x for x in self._leaves]
        bound = inspect.BoundArguments(self._sig, pytree.tree_unflatten(leaves, self._spec))
        return bound.args, bound.kwargs


class _Slot:
    """Stands for the output tensor `i` in an output template."""

    __slots__ = ("i",)

    def __init__(self, i):
        self.i = i

    def __deepcopy__(self, memo):
        raise AssertionError("an output template is copied with every slot in the memo")


class _Object:
    """Stands for the object `i` (a template holding slots) among an output's pytree leaves."""

    __slots__ = ("i",)

    def __init__(self, i):
        self.i = i


class Outputs:
    """The structure of a forward's output; `rebuild(tensors)` puts new tensors into it."""

    def __init__(self, spec, leaves, objects):
        self._spec = spec
        self._leaves = leaves  # per pytree leaf: a _Slot, an _Object, or a plain value
        self._objects = objects  # [(template, [_Slot])] of the leaves that are objects holding tensors

    @classmethod
    def of(cls, out):
        """(Outputs, the tensors of `out` in slot order, each once)."""
        leaves, spec = pytree.tree_flatten(out)
        tensors, slots = [], {}

        def slot(t):
            if id(t) not in slots:
                slots[id(t)] = _Slot(len(tensors))
                tensors.append(t)
            return slots[id(t)]

        kept, objects = [], []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                kept.append(slot(leaf))
            elif isinstance(leaf, _SCALARS):
                kept.append(leaf)
            else:
                held = _tensors_in(leaf)
                memo = {id(t): slot(t) for t in held}
                template = copy.deepcopy(leaf, memo)
                if _tensors_in(template):
                    raise TypeError(f"the model returns a {type(leaf).__name__} holding tensors a copy can't see")
                kept.append(_Object(len(objects)))
                objects.append((template, [memo[id(t)] for t in held]))
        return cls(spec, kept, objects), tensors

    def rebuild(self, tensors):
        """The output structure with `tensors` (in slot order) in it."""
        leaves = []
        for x in self._leaves:
            if isinstance(x, _Slot):
                x = tensors[x.i]
            elif isinstance(x, _Object):
                template, slots = self._objects[x.i]
                x = copy.deepcopy(template, {id(s): tensors[s.i] for s in slots})
            leaves.append(x)
        return pytree.tree_unflatten(leaves, self._spec)


def _tensors_in(obj) -> list:
    """The tensors an object reaches through containers and attributes, each once, in a fixed order."""
    found, seen = [], set()

    def walk(x):
        if id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple, set, frozenset)):
            for v in x:
                walk(v)
        elif hasattr(x, "__dict__") and not isinstance(x, (type, nn.Module)):
            for v in vars(x).values():
                walk(v)

    walk(obj)
    return found


def share(module: nn.Module, model: nn.Module) -> nn.Module:
    """`module`, made to hold `model`'s own parameter, buffer and submodule dicts (same objects,
    same dotted names, same state_dict keys) and its training mode."""
    module._parameters = model._parameters
    module._buffers = model._buffers
    module._modules = model._modules
    module._non_persistent_buffers_set = model._non_persistent_buffers_set
    module.training = model.training
    return module


class Flat(nn.Module):
    """`model` called with `call`'s arguments, taking their tensors and returning its outputs' tensors.

    It shares the model's parameter, buffer and submodule dicts, so both captures name
    each parameter and buffer by its dotted path in the model.
    """

    def __init__(self, model: nn.Module, call: Call):
        super().__init__()
        # An instance attribute shadows a submodule of the same name, and models name theirs
        # `model` (Hugging Face's decoders: `self.model = LlamaModel(...)`); export looks up
        # `model.embed_tokens` through this module.
        object.__setattr__(self, "_ratex_model", model)
        share(self, model)
        # Not the call's own tensors: a module sits in reference cycles, which keep what it holds
        # alive until the garbage collector runs, and a pending lazy input kept alive is computed
        # and returned by the next mark_step, a graph of its own that later steps don't repeat.
        self.call = call.without_tensors()
        # Set inside an object: export restores the module attributes (and the containers
        # among them) that a forward assigns.
        self._last = types.SimpleNamespace(outputs=None)

    @property
    def outputs(self):
        """The Outputs of the last call."""
        return self._last.outputs

    def forward(self, *tensors):
        args, kwargs = self.call.rebuild(tensors)
        self._last.outputs, flat = Outputs.of(self._ratex_model(*args, **kwargs))
        return tuple(flat)


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


class DataReads(torch.overrides.TorchFunctionMode):
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


# Loggers whose warnings a failed or successful capture would print: which guard failed
# and where, what was specialized. The capture's outcome is reported as one warning instead.
_NOISY_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch.export", "torch._export")


@contextlib.contextmanager
def _quiet():
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            # The trace's shape checks warn, and so do both APIs' deprecations; data reads are
            # caught by DataReads (trace) and by export itself.
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def trace(flat: Flat, metas):
    """TorchScript's inlined graph of `flat` on inputs of `metas` [(shape, dtype)] (raises where
    tracing would be unfaithful)."""
    with _quiet():
        examples = [_example(*m) for m in metas]
        with DataReads(examples + list(flat.parameters()) + list(flat.buffers())):
            traced = torch.jit.trace(flat, tuple(examples), check_trace=False)
    return traced.inlined_graph


def export(flat: Flat, metas):
    """torch.export's program of `flat` on inputs of `metas` [(shape, dtype)]: functional ATen,
    composite ops kept."""
    with _quiet():
        ep = torch.export.export(flat, tuple(_example(*m) for m in metas), strict=False)
        return ep.run_decompositions({})


def _example(shape, dtype) -> torch.Tensor:
    """A CPU tensor of this shape and dtype; values don't matter (reading them refuses the capture)."""
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    return torch.zeros(shape, dtype=dtype)
