"""Where device data lives and how it crosses to TVM and back.

On CPU, device data is a contiguous torch CPU tensor that TVM reads and
writes through DLPack without copies, or the tvm-ffi tensor a program run on
the native runner returned (most outputs only ever go back into the next
program, so only those that are read become torch tensors, with no copy). On
GPU it is a `tvm.runtime.Tensor` in CUDA memory (allocated by PyTorch's CUDA
allocator where torch has CUDA, and shared with TVM by DLPack). Nothing
outside this module needs to know which.

Each backend is registered under the name of its compile target
(tvm_lowering/targets.py); RATEX_DEVICE picks both.
"""
import functools

import torch
import tvm

from .. import config
from tvm_lowering import resolve_target

LAZY = torch.device("lazy", 0)
BACKENDS = {}  # target name -> the backend class that exchanges its data


def register(name: str):
    """Class decorator: register a backend as the data exchange of target `name`; returns the class."""

    def add(cls):
        cls.name = name
        BACKENDS[name] = cls
        return cls

    return add


@register("CPU")
class CPUBackend:
    """Device data = contiguous torch CPU tensors, or tvm-ffi tensors from the native runner
    (a torch tensor costs more to make from one than the tvm-ffi tensor: LeNet-5 b1 returns 33
    outputs a step, most read only by the next program)."""

    native_runner = True  # programs may run on the native runner's thread (csrc/runner.cc)
    native_kernels = True  # the C++ library kernels (csrc/kernels.cc) make CPU tensors: they fit here
    library_runs = True  # ratex.lib.* kernels run PyTorch's CPU kernels

    def __init__(self):
        self.target = resolve_target("CPU")

    def upload(self, cpu: torch.Tensor):
        """Return device data holding a private copy of `cpu`."""
        return cpu.detach().clone(memory_format=torch.contiguous_format)

    def adopt(self, cpu: torch.Tensor):
        """Return device data that takes over `cpu` (caller promises not to keep it)."""
        return cpu if cpu.is_contiguous() else cpu.contiguous()

    def full(self, shape: tuple, value, dtype: torch.dtype):
        """Return new device data of `shape` and `dtype` holding `value` everywhere."""
        return torch.full(shape, value, dtype=dtype)

    def download(self, data) -> torch.Tensor:
        """Return a CPU tensor the caller may modify."""
        return self.view_cpu(data).clone()

    def view_cpu(self, data) -> torch.Tensor:
        """Return a read-only-by-convention CPU view of the data (no copy when possible)."""
        return data if type(data) is torch.Tensor else torch.from_dlpack(data)

    def call(self, fn, inputs: list, empty: bool) -> list:
        """Run the compiled function `fn` on device data; return its outputs as device data.

        TVM's FFI takes torch tensors as arguments and, given one, returns torch tensors: the
        DLPack exchange happens in C, not in a Python call per tensor on the executor thread
        (where each one waited for the GIL while Python traced the next step). `empty`: some
        input has no elements, whose DLPack strides TVM may not take as compact. The
        outputs come back as an ffi Array: a slice lists it in one pass, where iterating
        it costs a length check and an index check per element (LeNet-5 b1's 22 outputs:
        ~60 us of the executor thread's time under the GIL, which tracing waits for).
        """
        if empty:
            inputs = [self._empty(x) if x.numel() == 0 else x for x in inputs]
        outs = fn(*inputs)[:]
        return [o if type(o) is torch.Tensor else torch.from_dlpack(o) for o in outs]

    @staticmethod
    def _empty(data):
        return tvm.runtime.empty(tuple(data.shape), str(data.dtype).replace("torch.", ""), tvm.cpu())

    def copy(self, data):
        """Return device data holding a copy of `data` in a buffer of its own."""
        return self.view_cpu(data).clone()


@register("GPU")
class GPUBackend:
    """Device data = tvm.runtime.Tensor on the CUDA device."""

    native_runner = False
    native_kernels = False  # they make CPU tensors; the Python kernels run torch's CUDA ones
    library_runs = False  # ... where this torch has CUDA (set per instance)

    def __init__(self):
        self.target = resolve_target("GPU", _cuda_arch())
        self.dev = tvm.cuda(0)
        self.torch_cuda = self.library_runs = torch.cuda.is_available()

    def upload(self, cpu: torch.Tensor):
        if self.torch_cuda and cpu.numel() > 0:
            # From pinned memory the copy is queued behind the running program and this thread
            # goes on tracing; TVM's own copy (below) waits for that program to finish.
            pinned = cpu.detach().contiguous().pin_memory()
            return tvm.runtime.from_dlpack(pinned.to("cuda", non_blocking=True))
        return tvm.runtime.tensor(_numpy(cpu), device=self.dev)

    adopt = upload

    def full(self, shape: tuple, value, dtype: torch.dtype):
        if self.torch_cuda:  # filled on the GPU, in the order of the uploads
            return tvm.runtime.from_dlpack(torch.full(shape, value, dtype=dtype, device="cuda"))
        return self.upload(torch.full(shape, value, dtype=dtype))

    def download(self, data) -> torch.Tensor:
        return _from_numpy(data.numpy(), data.dtype)

    view_cpu = download

    def call(self, fn, inputs: list, empty: bool) -> list:
        outs = list(fn(*inputs))
        # Kernels launch asynchronously: wait here, on the executor thread, so that a program
        # counts as done (wait_device_ops, ExecuteTime) when its kernels have run.
        self.dev.sync()
        return outs

    def copy(self, data):
        return data.copyto(self.dev)


def _numpy(cpu: torch.Tensor):
    t = cpu.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy()  # numpy has no bf16; bits travel as int16
    return t.numpy()


def _from_numpy(array, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(array.copy())
    return t.view(torch.bfloat16) if str(dtype) == "bfloat16" else t


def _cuda_arch() -> str:
    dev = tvm.cuda(0)
    if not dev.exist:
        raise RuntimeError(
            "RATEX_DEVICE=GPU but no CUDA device is visible to TVM; "
            "use RATEX_DEVICE=CPU or run on a machine with an NVIDIA GPU"
        )
    major, minor = str(dev.compute_version).split(".")
    return f"sm_{major}{minor}"


def backend_class():
    """Return the backend class registered for the RATEX_DEVICE target."""
    cls = BACKENDS.get(config.DEVICE)
    if cls is None:
        raise RuntimeError(f"RATEX_DEVICE={config.DEVICE}: no backend is registered for this target "
                           f"in ratex/core/device.py (registered: {', '.join(BACKENDS)})")
    return cls


@functools.lru_cache(maxsize=None)
def backend():
    """Return the backend of the RATEX_DEVICE target (created on first use)."""
    return backend_class()()
