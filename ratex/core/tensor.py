"""LazyTensor: a torch.Tensor on the `lazy` device that records ops instead of running them.

Every tensor points at a `Storage` (storage.py; shared by a base tensor and all
its views) holding the base's current value, plus the chain of view ops that
leads from the base to this tensor. Reads replay the chain when the storage
changed; in-place writes compute the new value functionally and scatter it back
through the chain (chain.py), so a write through any view is seen by all.

Ops on lazy tensors go to the tracer (ratex/core/tracing), reads of pending values
to the sync layer (ratex/core/sync.py): both sit above this module and install
their entry points here (see `install`).
"""
import collections

import torch
from torch.utils._pytree import tree_map
from torch.nn.parameter import UninitializedTensorMixin

from . import launch, metrics
from .chain import replay, scatter_back
from .device import LAZY, backend
from .ir import Meta, Node
from .shape import contiguous_strides
from .storage import Storage

aten = torch.ops.aten


class LazyTensor(torch.Tensor):
    """A tensor on device lazy:0 whose value is a lazy IR value (see module doc)."""

    @staticmethod
    def __new__(cls, storage, chain, meta, stride=None, offset=0, value=None):
        shape, dtype = meta
        contiguous = contiguous_strides(shape)
        if offset == 0 and (stride is None or stride == contiguous):  # usual: a cheaper wrapper
            stride = contiguous
            t = _make_wrapper(cls, shape, dtype=dtype, device=LAZY)
        else:
            stride = tuple(stride)
            t = _make_wrapper(cls, shape, strides=stride, storage_offset=offset, dtype=dtype, device=LAZY)
        t._st = storage
        t._chain = chain
        t._cache = (storage.version, value)
        t._sig = (shape, stride, dtype)  # shape inference's view of this tensor
        _counts["CreateLazyTensor"] += 1
        return t

    def __del__(self, _counts=metrics.counts):  # bound here: module globals may be gone at exit
        _counts["DestroyLazyTensor"] += 1

    # ---- construction -------------------------------------------------
    @classmethod
    def from_value(cls, value, stride=None, offset=0):
        """Return a new base tensor whose value is `value` (a pending or computed IR value)."""
        node, idx = value
        return cls(Storage(value), (), node.metas[idx], stride, offset)

    @classmethod
    def from_cpu(cls, cpu: torch.Tensor, adopt=False):
        """Return a lazy tensor holding a copy of the CPU tensor `cpu` (or `cpu` itself if adopt)."""
        if cpu.layout is not torch.strided:
            raise NotImplementedError(
                f"moving a {cpu.layout} tensor to the lazy device: it holds dense (torch.strided) tensors, and "
                "sparse COO tensors only as the gradients of nn.Embedding(sparse=True) or F.embedding(sparse=True) "
                "and what is computed from them; move the tensor's .to_dense()")
        be = backend()
        metrics.counter_inc("DeviceDataTransfer")
        data = be.adopt(cpu) if adopt else be.upload(cpu)
        return cls.from_value((Node.leaf(data, Meta(tuple(cpu.shape), cpu.dtype)), 0))

    # ---- value access ---------------------------------------------------
    def _value(self):
        if not self._chain:
            return self._st.value
        version, value = self._cache
        if version != self._st.version or value is None:
            value = self._st.value
            for op, spec in self._chain:
                value = replay(op, spec, value)
            self._cache = (self._st.version, value)
        return value

    def _meta(self):
        return Meta(tuple(self.shape), self.dtype)

    def _device_data(self):
        """Return computed device data of this tensor, running what is pending."""
        value = self._value()
        if value[0].results[value[1]] is None:
            _execute([value])
            if not self._chain:
                self._st.rebind()
        node, idx = value
        return launch.read(node.results[idx])

    def _to_cpu(self) -> torch.Tensor:
        return backend().download(self._device_data(), self.dtype)

    def _write(self, value):
        """Make `value` this tensor's new value, updating the base through the view chain."""
        if not self._chain:
            self._st.write(value)
            return
        bases = [self._st.value]
        for op, spec in self._chain[:-1]:
            bases.append(replay(op, spec, bases[-1]))
        new = value
        for (op, spec), base in zip(reversed(self._chain), reversed(bases)):
            new = scatter_back(op, spec, base, new)
        self._st.write(new)
        self._cache = (self._st.version, value)

    def _assume(self, other: "LazyTensor"):
        """Become `other` (shape, strides and aliasing) in place: `p.data = t`, `x.t_()`."""
        _set_data(self, other)  # updates the C++ metadata (sizes, strides, dtype)
        self._st, self._chain, self._cache, self._sig = other._st, other._chain, other._cache, other._sig

    @property
    def data(self):
        return _get_data(self)

    @data.setter
    def data(self, new):
        if not isinstance(new, LazyTensor):
            raise RuntimeError(
                f"cannot assign a {new.device} tensor to .data of a lazy:0 tensor; move it with .to('lazy') first"
            )
        self._assume(new)

    # The traceable-wrapper protocol (torch.utils._python_dispatch). Module._apply, given a
    # tensor that follows it, swaps a parameter's contents for its converted copy
    # (torch.utils.swap_tensors) instead of putting a new Parameter in each module that holds
    # the old one: parameters tied across modules then stay one tensor on the lazy device, as
    # `.data =` keeps them on CUDA. A lazy tensor holds no inner tensors: its value is its
    # Storage, which the context carries.
    def __tensor_flatten__(self):
        return [], (self._st, self._chain, self.dtype, self.storage_offset())

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        storage, chain, dtype, offset = ctx
        return LazyTensor(storage, chain, Meta(tuple(outer_size), dtype), tuple(outer_stride), offset)

    # ---- user-facing conveniences ---------------------------------------
    def __repr__(self, *, tensor_contents=None):
        text = repr(self._to_cpu())
        extras = [f"device='{LAZY}'"]
        if self.grad_fn is not None:
            extras.append(f"grad_fn=<{type(self.grad_fn).__name__}>")
        elif self.requires_grad:
            extras.append("requires_grad=True")
        return text[:-1] + ", " + ", ".join(extras) + ")"

    def tolist(self):
        return self._to_cpu().tolist()

    def numpy(self, *, force=False):
        return self._to_cpu().numpy()

    def __array__(self, dtype=None, copy=None):
        arr = self._to_cpu().numpy()
        return arr if dtype is None else arr.astype(dtype)

    def __reduce_ex__(self, protocol):
        # Pickled as the CPU tensor (or Parameter) it holds, with torch's own rebuild functions:
        # torch.load opens the file where ratex is not imported and under weights_only, onto the
        # CPU unless map_location names the lazy device (tracing/saved.py). The device data is
        # shared, not copied, so aliases of one value save one storage.
        cpu = backend().view_cpu(self._device_data(), self.dtype).detach()
        if isinstance(self, torch.nn.Parameter):
            return (torch._utils._rebuild_parameter, (cpu, self.requires_grad, collections.OrderedDict()))
        return cpu.requires_grad_(self.requires_grad).__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        new = LazyTensor.from_cpu(self._to_cpu(), adopt=True)
        if isinstance(self, torch.nn.Parameter):
            new = torch.nn.Parameter(new, self.requires_grad)
        elif self.requires_grad:
            new.requires_grad_(True)
        memo[id(self)] = new
        return new

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if len(types) > 1 and not all(issubclass(t, LazyTensor) for t in types):
            # Another tensor subclass among the arguments (a sparse lazy tensor: tracing/sparse.py)
            # knows what the call means; torch asks it next.
            return NotImplemented
        return _dispatch(func, args, kwargs or {})


class _UninitializedLazy:
    """What an uninitialized parameter or buffer of a torch.nn Lazy* module is once moved to the
    lazy device: still uninitialized, as `.to('cuda')` leaves it.

    `.to('cuda')` moves such a tensor's `.data` and keeps the object; here Module._apply swaps the
    CPU object for this one (a lazy tensor is a traceable wrapper), so this one must be
    uninitialized itself. The module's first call materializes it on the lazy device
    (`torch.empty(shape, device=self.data.device)`), it becomes a plain LazyTensor, and
    `reset_parameters` fills it with random ops traced like any other.
    """

    __new__ = LazyTensor.__new__
    cls_to_become = LazyTensor
    # Module._apply wraps the moved tensor in nn.Parameter, which detaches it and sets requires_grad.
    _allowed_methods = UninitializedTensorMixin._allowed_methods + [torch.Tensor.detach, torch.Tensor.requires_grad_]

    @classmethod
    def _empty(cls, dtype, requires_grad):
        t = cls.from_cpu(torch.empty(0, dtype=dtype), adopt=True)
        t.requires_grad_(requires_grad)
        if issubclass(cls, torch.nn.Parameter):
            t._is_param = True  # what nn.Parameter() marks a wrapper with; it outlives materializing
        return t

    def detach(self):
        """Return an uninitialized lazy tensor of the same kind that does not require grad
        (nn.Parameter demands that detach keep a wrapper's type)."""
        return type(self)._empty(self.dtype, False)

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = type(self)._empty(self.dtype, self.requires_grad)
        return memo[id(self)]

    def __reduce_ex__(self, protocol):
        # Saved as torch's own uninitialized kind, which loads on the CPU where ratex is not imported.
        return (self._torch_kind, (self.requires_grad, None, self.dtype))


class _UninitializedLazyParameter(_UninitializedLazy, torch.nn.UninitializedParameter, LazyTensor):
    """An uninitialized parameter on the lazy device (see _UninitializedLazy)."""

    _torch_kind = torch.nn.UninitializedParameter


class _UninitializedLazyBuffer(_UninitializedLazy, torch.nn.UninitializedBuffer, LazyTensor):
    """An uninitialized buffer on the lazy device (see _UninitializedLazy)."""

    _torch_kind = torch.nn.UninitializedBuffer


def uninitialized_like(src, dtype):
    """Return an uninitialized lazy parameter or buffer (as `src` is one or the other) of `dtype`."""
    kind = _UninitializedLazyParameter if isinstance(src, torch.nn.Parameter) else _UninitializedLazyBuffer
    return kind._empty(dtype, src.requires_grad)


_make_wrapper = torch.Tensor._make_wrapper_subclass
_counts = metrics.counts
_get_data = torch._C.TensorBase.data.__get__
_set_data = torch._C.TensorBase.data.__set__


def check_device(device) -> torch.device:
    """Return the lazy device `device` (a torch.device or a string such as 'lazy:0') names; raise a
    ValueError naming it where its index is not 0, since ratex has one lazy device."""
    device = torch.device(device)
    if device.index not in (None, 0):
        raise ValueError(
            f"lazy device index {device.index} ({str(device)!r}) does not exist; ratex has one lazy device: "
            "'lazy' or 'lazy:0'"
        )
    return LAZY


def is_lazy(t) -> bool:
    """Return whether `t` is a tensor on the lazy device."""
    return isinstance(t, LazyTensor)


# ---- entry points of the layers above ------------------------------------------------
# Tracing an op on a lazy tensor is the job of ratex/core/tracing, computing a pending
# value the job of ratex/core/sync.py; both import this module. Each installs its entry
# point here when it is imported, so that this module imports neither (`import ratex`
# loads both).
def _missing(what, module):
    def fail(*args, **kwargs):
        raise RuntimeError(f"ratex: {what} needs {module}, which is not loaded; `import ratex` loads it")

    return fail


_dispatch = _missing("tracing an op on a lazy tensor", "ratex.core.tracing")  # dispatch(func, args, kwargs)
_execute = _missing("reading a lazy tensor", "ratex.core.sync")  # execute(values): compute pending values


def install(*, dispatch=None, execute=None):
    """Make `dispatch` the tracer of ops on lazy tensors and/or `execute` what computes pending
    values (each layer passes its own at import); return None."""
    global _dispatch, _execute
    if dispatch is not None:
        _dispatch = dispatch
    if execute is not None:
        _execute = execute


# ---- the Lazy dispatch key: ops that create lazy tensors from nothing lazy --------
_MOVE_ONLY = frozenset(("device", "pin_memory", "non_blocking", "layout"))


def _lazy_key_kernel(op, *args, **kwargs):
    """Factories with device='lazy' and `cpu.to('lazy')`: run on CPU, keep the result as data."""
    device = kwargs.get("device")
    if device is not None and device.type == "lazy":
        check_device(device)
    if op is aten._to_copy.default:
        src = args[0]
        if isinstance(src, UninitializedTensorMixin):
            return uninitialized_like(src, kwargs.get("dtype") or src.dtype)
        kw = {k: v for k, v in kwargs.items() if k not in _MOVE_ONLY and not (k == "dtype" and v == src.dtype)}
        out = aten._to_copy.default(src, **kw) if kw else src  # x.to('lazy') comes with its own dtype: no cast
        return LazyTensor.from_cpu(out, adopt=out is not src)
    kwargs = {k: (torch.device("cpu") if k == "device" else v) for k, v in kwargs.items()}
    out = op(*args, **kwargs)
    return tree_map(lambda o: LazyTensor.from_cpu(o, adopt=True) if isinstance(o, torch.Tensor) else o, out)


_lib = torch.library.Library("_", "IMPL")
_lib.fallback(_lazy_key_kernel, dispatch_key="Lazy")
# Some C++ paths (torch.tensor(..., device='lazy'), indexing with Python lists) reach
# these through a route the boxed fallback doesn't serve; explicit kernels do.
_aten_lib = torch.library.Library("aten", "IMPL", "Lazy")
for _op in (aten._to_copy.default, aten.empty.memory_format, aten.empty_strided.default):
    _aten_lib.impl(_op._schema.name.split("::")[1] + ("." + _op._overloadname if _op._overloadname != "default" else ""),
                   lambda *a, _op=_op, **k: _lazy_key_kernel(_op, *a, **k))
