"""Environment configuration, validated once at import so bad values fail early."""
import ctypes
import os
import sys

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _choice(name: str, default: str, valid: tuple) -> str:
    raw = os.environ.get(name, default)
    value = raw.strip().upper()
    if value not in valid:
        raise ValueError(f"{name}={raw!r} is not valid; use one of: {', '.join(valid)}")
    return value


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not valid; use true or false")


def _cache_dir():
    raw = os.environ.get("RATEX_CACHE_DIR")
    if raw is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "ratex")
    raw = raw.strip()
    return os.path.abspath(os.path.expanduser(raw)) if raw else None  # "" disables the disk cache


def _positive_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{name}={raw!r} is not valid; use a positive whole number")
    return value


def _tune_trials() -> int:
    """RATEX_TUNE: MetaSchedule trials per new kernel (0: no tuning); records live in the cache dir."""
    raw = os.environ.get("RATEX_TUNE")
    if raw is None or not raw.strip():
        return 0
    try:
        trials = int(raw)
    except ValueError:
        trials = -1
    if trials < 0:
        raise ValueError(f"RATEX_TUNE={raw!r} is not valid; use a whole number of tuning trials per kernel (0: off)")
    if trials and DEVICE != "CPU":
        raise ValueError(f"RATEX_TUNE={raw!r}: tuning is for CPU kernels only, but RATEX_DEVICE={DEVICE}")
    if trials and CACHE_DIR is None:
        raise ValueError(
            f"RATEX_TUNE={raw!r} needs a directory for the tuning records, but RATEX_CACHE_DIR is empty "
            "(the persistent cache is disabled); set RATEX_CACHE_DIR to a directory"
        )
    return trials


DEVICE = _choice("RATEX_DEVICE", "CPU", ("CPU", "GPU"))
# How heavy ops (matmul, conv) run: TVM-generated code, or the kernel library
# (PyTorch's kernels called from the compiled program). auto = library on CPU.
KERNELS = _choice("RATEX_KERNELS", "AUTO", ("AUTO", "TVM", "LIBRARY"))
# TVM pins its worker threads to cores by default; next to torch's own pool
# (library kernels run in-process) the two fight for the cores.
os.environ.setdefault("TVM_BIND_THREADS", "0")
# TVM's idle workers spin (300,000 polls) before they sleep, holding a core that torch's
# pool (library kernels) and the thread tracing the next step need. On 2 cores that
# turned LeNet-5's 2.2 ms program into bursts of 30-140 ms every 20-40 steps (the
# tutorial at batch 32, 2 threads); with workers that sleep at once it stays at 2-2.5 ms.
os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")
# One thread budget: a compiled program runs TVM kernels on TVM's pool and library
# kernels on torch's, one after the other, so both get the same number of threads:
# RATEX_NUM_THREADS when set, else torch's (OMP_NUM_THREADS or the core count).
# TVM_NUM_THREADS, when the user set it, is left alone.
NUM_THREADS = _positive_int("RATEX_NUM_THREADS", 0)


def _share_threads():
    import torch  # noqa: PLC0415  (config is imported before anything else of ratex)

    if NUM_THREADS:
        torch.set_num_threads(NUM_THREADS)
    os.environ.setdefault("TVM_NUM_THREADS", str(torch.get_num_threads()))


_share_threads()
# Freed CPU buffers stay with the process, as CUDA's caching allocator keeps device memory.
# With glibc's defaults a freed block of a few MB goes back to the OS (munmap, or a trim of
# the executor thread's heap), and the next step page-faults its activations in again:
# MNIST Net b64 took 13,700 faults per step, 16-25 ms of a 70-74 ms step. Above 32 MB blocks are still
# mapped and unmapped; up to 256 MB of free memory stays at the top of each heap.
# RATEX_RETAIN_MEMORY=false, or a MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ of
# your own, keeps glibc's behaviour.
RETAIN_MEMORY = _flag("RATEX_RETAIN_MEMORY", True)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def _retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds; whether they were set."""
    if not RETAIN_MEMORY or not sys.platform.startswith("linux"):
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 256 << 20))


MEMORY_RETAINED = _retain_freed_memory()
# Buffer donation: at mark_step, a tensor whose new value the step computes gives
# its old buffer to that computation, which writes the update in place where
# tvm_lowering/inplace.py proves it safe (the peak memory of a training step drops
# by about the size of parameters + optimizer state). A donated buffer cannot be
# restored: if the program fails, the tensors that owned donated buffers are not
# rolled back like the others but keep the failed value, so reading them raises
# the step's error again rather than returning a half-updated buffer.
PARAM_ALIASING = _flag("ENABLE_PARAM_ALIASING", False)
PROFILE = _flag("RATEX_PROFILE", False)
# Compiled CPU programs run on the native runner's thread (csrc/runner.cc), which never takes
# the GIL; false (or no native library) runs them on a Python thread (ratex/core/launch.py).
NATIVE_RUNNER = _flag("RATEX_NATIVE_RUNNER", True)
SAVE_IR = os.environ.get("RATEX_SAVE_IR") or None
CACHE_DIR = _cache_dir()  # None: no persistent compile cache
CACHE_SIZE_MB = _positive_int("RATEX_CACHE_SIZE_MB", 1024)
TUNE = _tune_trials()  # 0: apply existing tuning records only
