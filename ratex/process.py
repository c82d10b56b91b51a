"""What `import ratex` changes in the process, and why. Each change has an opt-out.

| change | why | opt-out |
|---|---|---|
| `TVM_THREAD_POOL_SPIN_COUNT=0`, `TVM_BIND_THREADS=0` | TVM's idle workers otherwise spin, pinned to their cores, holding the cores that torch's pool (library kernels) and the thread tracing the next step need | `RATEX_TVM_POOL_YIELD=false`, or either variable set yourself |
| `TVM_NUM_THREADS` = torch's thread count; torch's = `RATEX_NUM_THREADS` where set | a program runs TVM kernels on TVM's pool and library kernels on torch's, one after the other: one thread budget for both | `RATEX_SHARE_THREADS=false` (TVM's default: all cores), or `TVM_NUM_THREADS` set yourself; torch's count changes only with `RATEX_NUM_THREADS` |
| glibc's mmap threshold 32 MB, trim threshold 256 MB | freed buffers stay with the process, as PyTorch's CUDA caching allocator keeps device memory: with glibc's defaults a freed block of a few MB goes back to the OS and the next step page-faults it in again | `RATEX_RETAIN_MEMORY=false`, or `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` set yourself; nothing off glibc |
| `torch._lazy.mark_step`, `wait_device_ops` and `sync_multi` run ratex's; `torch._lazy.metrics` reads ratex's counters | ratex is the lazy device's backend: code written for torch._lazy steps it, and reads its counters, too | `RATEX_TORCH_LAZY_STEP=false` |
| after the first step that compiles nothing following one that compiled: `gc.collect()`, then `gc.freeze()` | a traced step makes thousands of objects that outlive a young collection and die at mark_step without cycles; they count towards CPython's next full collection, which then scans the whole heap (torch, transformers, the model) every few dozen steps. Frozen objects are still freed by reference counting; cyclic garbage among them (none in a steady training step, nor in torch modules and optimizers) waits for a later settle that unfreezes | `RATEX_GC_FREEZE=false` |

The settings come from ratex/config.py, which parses them.
"""
import ctypes
import gc
import os
import sys
import time

import torch
import torch._lazy
import torch._lazy.metrics

from . import config

TVM_THREADS = None  # the thread count TVM's pool will use (None: TVM's default, all cores)
MEMORY_RETAINED = False  # whether glibc's thresholds were raised
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def apply():
    """Apply the thread and memory settings (first thing at import: TVM reads its variables when
    its thread pool starts); returns nothing."""
    global MEMORY_RETAINED
    _yield_tvm_pool()
    _share_threads()
    MEMORY_RETAINED = _retain_freed_memory()


def _yield_tvm_pool():
    # Spinning idle workers (300,000 polls before they sleep) turned a small LeNet-5 program
    # into bursts many times its length on 2 cores; pinned ones fight torch's pool for cores.
    if config.TVM_POOL_YIELD:
        os.environ.setdefault("TVM_BIND_THREADS", "0")
        os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")


def _share_threads():
    global TVM_THREADS
    if config.NUM_THREADS:
        torch.set_num_threads(config.NUM_THREADS)
    if config.TVM_NUM_THREADS is not None:
        TVM_THREADS = config.TVM_NUM_THREADS or None  # 0: TVM's default
    elif config.SHARE_THREADS:
        TVM_THREADS = torch.get_num_threads()  # RATEX_NUM_THREADS, else OMP_NUM_THREADS or the core count
        os.environ["TVM_NUM_THREADS"] = str(TVM_THREADS)


def _retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds; return whether they were set.

    With glibc's defaults a freed block of a few MB is unmapped (or trimmed off the
    executor thread's heap), and the next step page-faults its activations in again: a
    MNIST Net b64 step spent a quarter of its time in page faults. Above 32 MB blocks
    are still mapped and unmapped; up to 256 MB of free memory stays at the top of each heap.
    """
    if not config.RETAIN_MEMORY or not sys.platform.startswith("linux"):
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 256 << 20))


def drive_torch_lazy(lazy_model, metrics) -> bool:
    """Make torch._lazy's mark_step, wait_device_ops and sync_multi call `lazy_model`'s, and
    torch._lazy.metrics read `metrics` (unless RATEX_TORCH_LAZY_STEP=false); return whether they do."""
    if not config.TORCH_LAZY_STEP:
        return False

    def torch_lazy_mark_step(device: str = "", wait: bool = False):
        lazy_model.mark_step()
        if wait:
            lazy_model.wait_device_ops()

    torch._lazy.mark_step = torch_lazy_mark_step
    torch._lazy.wait_device_ops = lambda devices=None: lazy_model.wait_device_ops()
    # torch._lazy.to_cpu and torch._lazy.save sync through this name before copying.
    torch._lazy.sync_multi = lambda tensors, devices=None: lazy_model.sync_tensors(tensors)
    for name in ("counter_names", "counter_value", "metrics_report", "reset"):
        setattr(torch._lazy.metrics, name, getattr(metrics, name))
    return True


_heap = {"grew": True, "now": False, "full_at": None, "full_cost": 0.0}
_FULL_SHARE = 0.02  # the most of the time between settles that full collections may take


def heap_grew():
    """Note that a program was compiled or loaded (its objects join the heap); returns nothing."""
    _heap["grew"] = _heap["now"] = True


def settle_heap() -> bool:
    """At the end of a step: if it made no program but programs were made since the last settle,
    collect the cyclic garbage and freeze what is left out of the GC's later scans (see the
    table above; RATEX_GC_FREEZE=false: never). Return whether it did.

    A frozen object that becomes cyclic garbage later (a model in a reference cycle, deleted)
    is not collected while frozen, so a settle unfreezes and collects the whole heap when that
    keeps full collections under 2% of the time since the last one; otherwise it collects only
    what is not frozen yet, which costs little once the large, old part of the heap is frozen.
    """
    if _heap["now"]:
        _heap["now"] = False  # a step that compiled: the one after it is the first steady one
        return False
    if not _heap["grew"] or not config.GC_FREEZE:
        return False
    _heap["grew"] = False
    start = time.perf_counter()
    full = _heap["full_at"] is None or start - _heap["full_at"] >= _heap["full_cost"] / _FULL_SHARE
    if full:
        gc.unfreeze()
    gc.collect()
    gc.freeze()
    if full:
        _heap["full_at"] = end = time.perf_counter()
        _heap["full_cost"] = end - start
    return True
