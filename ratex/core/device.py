"""Where device data lives and how it crosses to TVM and back.

On CPU, device data is a contiguous torch CPU tensor that TVM reads and
writes through DLPack without copies, or the tvm-ffi tensor a program run on
the native runner returned (most outputs only ever go back into the next
program, so only those that are read become torch tensors, with no copy). On
GPU it is a torch CUDA tensor, shared with TVM by DLPack both ways (never
through numpy). Nothing outside this module needs to know which.

Each backend is registered under the name of its compile target
(tvm_lowering/targets.py); RATEX_DEVICE picks both.

Under RATEX_USE_BF16 the device data of a float32 tensor are bfloat16 (`stored_dtype`): data
going in are rounded to bfloat16, data coming out are widened to the dtype the caller names.
"""
import functools

import torch
import tvm

from .. import config
from tvm_lowering import resolve_target

LAZY = torch.device("lazy", 0)
BACKENDS = {}  # target name -> the backend class that exchanges its data


def stored_dtype(dtype: torch.dtype) -> torch.dtype:
    """Return the dtype of the device data of a tensor of `dtype`: bfloat16 for float32 under
    RATEX_USE_BF16, else `dtype` itself."""
    return torch.bfloat16 if dtype is torch.float32 and config.USE_BF16 else dtype


def _widened(cpu: torch.Tensor, dtype) -> torch.Tensor:
    """`cpu` as `dtype` (a new tensor), or `cpu` itself where `dtype` is None or its own."""
    return cpu if dtype is None or cpu.dtype is dtype else cpu.to(dtype)


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
    native_kernels = "cpu"  # the device type the C++ library kernels (csrc/kernels.cc) must handle
    library_runs = True  # ratex.lib.* kernels run PyTorch's CPU kernels

    def __init__(self):
        self.target = resolve_target("CPU")

    def upload(self, cpu: torch.Tensor):
        """Return device data holding a private copy of `cpu`."""
        stored = stored_dtype(cpu.dtype)
        if stored is not cpu.dtype:
            return cpu.detach().to(stored, memory_format=torch.contiguous_format)
        return cpu.detach().clone(memory_format=torch.contiguous_format)

    def adopt(self, cpu: torch.Tensor):
        """Return device data that takes over `cpu` (caller promises not to keep it)."""
        stored = stored_dtype(cpu.dtype)
        if stored is not cpu.dtype:
            return cpu.to(stored, memory_format=torch.contiguous_format)
        return cpu if cpu.is_contiguous() else cpu.contiguous()

    def full(self, shape: tuple, value, dtype: torch.dtype):
        """Return new device data of `shape` for a tensor of `dtype`, holding `value` everywhere."""
        return torch.full(shape, value, dtype=stored_dtype(dtype))

    def download(self, data, dtype: torch.dtype = None) -> torch.Tensor:
        """Return a CPU tensor the caller may modify, of `dtype` (default: the data's own)."""
        cpu = self.view_cpu(data)
        return cpu.clone() if dtype is None or cpu.dtype is dtype else cpu.to(dtype)

    def view_cpu(self, data, dtype: torch.dtype = None) -> torch.Tensor:
        """Return a read-only-by-convention CPU view of the data as `dtype` (default: the data's
        own; no copy when possible)."""
        return _widened(data if type(data) is torch.Tensor else torch.from_dlpack(data), dtype)

    def call(self, fn, inputs: list, empty: bool) -> list:
        """Run the compiled function `fn` on device data; return its outputs as device data.

        TVM's FFI takes torch tensors as arguments and, given one, returns torch tensors: the
        DLPack exchange happens in C, not in a Python call per tensor on the executor thread
        (where each one would wait for the GIL while Python traces the next step). `empty`: some
        input has no elements, whose DLPack strides TVM may not take as compact. The
        outputs come back as an ffi Array: a slice lists it in one pass, where iterating
        it costs a length check and an index check per element (LeNet-5 b1's 22 outputs:
        noticeable executor-thread time under the GIL, which tracing waits for).
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


class DLPackBackend:
    """Device data = torch tensors on `torch_device`, which TVM reads and writes through DLPack:
    no copies between the two, every dtype torch has (bool, bfloat16, ...), and TVM's kernels,
    torch's library kernels and these copies all run in the order of one stream (torch's current
    stream, which tvm-ffi hands TVM for each call that passes torch tensors).

    The GPU backend is this class on CUDA. Built on the CPU device (tests), it runs the same code.
    """

    native_runner = False  # the native runner's thread is for CPU programs (csrc/runner.cc)
    native_kernels = None  # the device type the native kernels must handle (see kernels.py)
    library_runs = True  # ratex.lib.* kernels run torch's kernels for this device

    def __init__(self, target, torch_device: torch.device, tvm_device):
        self.target = target
        self.device = torch.device(torch_device)
        self.tvm_device = tvm_device
        cuda = self.device.type == "cuda"
        self._pinned = cuda  # host copies go through page-locked memory (see `upload`)
        # A program counts as done (wait_device_ops, ExecuteTime) once its kernels have run:
        # its executor thread waits for an event recorded behind them, not for the whole device.
        self._done = torch.cuda.Event() if cuda else None

    def upload(self, cpu: torch.Tensor):
        """Return device data holding a private copy of `cpu`; the copy is queued, not waited for."""
        src = cpu.detach()
        stored = stored_dtype(src.dtype)
        if src.numel() == 1:  # a scalar (a learning rate, every step): the fill kernel carries it, exactly
            return torch.full(src.shape, src.item(), dtype=stored, device=self.device)
        dst = torch.empty(src.shape, dtype=stored, device=self.device)
        if not src.numel():
            return dst
        if self._pinned:
            # From page-locked memory the copy is queued behind the running program and this
            # thread goes on tracing (from pageable memory it would wait for that program). The
            # staging buffer comes from torch's caching host allocator, which takes a block back
            # for reuse once the copy that reads it has run: no page-locking per upload.
            # Rounded to the stored dtype on the host: a bfloat16 copy moves half the bytes.
            src = torch.empty(src.shape, dtype=stored, pin_memory=True).copy_(src)
        return dst.copy_(src, non_blocking=True)

    adopt = upload

    def full(self, shape: tuple, value, dtype: torch.dtype):
        """Return new device data of `shape` for a tensor of `dtype`, holding `value` everywhere
        (filled on the device)."""
        return torch.full(shape, value, dtype=stored_dtype(dtype), device=self.device)

    def download(self, data, dtype: torch.dtype = None) -> torch.Tensor:
        """Return a CPU tensor the caller may modify, of `dtype` (default: the data's own; it
        waits for the kernels that write `data`)."""
        return _widened(self.tensor(data).to("cpu", copy=True), dtype)

    view_cpu = download

    @staticmethod
    def tensor(data) -> torch.Tensor:
        """Return device data as a torch tensor (a tvm-ffi tensor is viewed, not copied)."""
        return data if type(data) is torch.Tensor else torch.from_dlpack(data)

    def call(self, fn, inputs: list, empty: bool) -> list:
        """Run the compiled function `fn` on device data; return its outputs as device data, once
        its kernels have run. `empty`: some input has no elements (see CPUBackend.call)."""
        if empty:
            inputs = [self._empty(x) if x.numel() == 0 else x for x in inputs]
        outs = [self.tensor(o) for o in fn(*inputs)[:]]
        if self._done is not None:
            self._done.record()
            self._done.synchronize()
        return outs

    def _empty(self, data):
        return tvm.runtime.empty(tuple(data.shape), str(data.dtype).replace("torch.", ""), self.tvm_device)

    def copy(self, data):
        """Return device data holding a copy of `data` in a buffer of its own."""
        return self.tensor(data).clone()


@register("GPU")
class GPUBackend(DLPackBackend):
    """Device data = torch CUDA tensors: PyTorch's allocator holds them, TVM's kernels and the
    library's (torch's CUDA kernels) read and write them in place."""

    native_kernels = "cuda"  # where the native library was built against a torch with CUDA

    def __init__(self):
        arch = _cuda_arch()
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"RATEX_DEVICE=GPU needs a PyTorch build with CUDA, but torch {torch.__version__} has none "
                "(device data are torch CUDA tensors that TVM shares through DLPack); "
                "install a CUDA build of torch, or use RATEX_DEVICE=CPU"
            )
        super().__init__(resolve_target("GPU", arch), torch.device("cuda", 0), tvm.cuda(0))


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
