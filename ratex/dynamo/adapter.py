"""The one place where the compile front end reaches into the lazy path's core.

Everything `ratex.dynamo` shares with the lazy device goes through here: the
compile caches (the lazy path's memory cache object and its persistent
`RATEX_CACHE_DIR` cache), the kernel-library choice, tuning records, metrics,
the RNG seed scheme and the settings. When those move behind new interfaces,
this module is what follows them.
"""
import functools
import time
import warnings

import torch
import tvm

import tvm_lowering
from tvm_lowering import tuning
from .. import config
from ..core import executor, kernels, launch, metrics, progress, random, sync

counts = metrics.counts  # `counts[name] += 1` on per-call paths
record = metrics.record
counter_inc = metrics.counter_inc
new_seed = random.new_seed
DROPOUT_KEEP = torch.ops.ratex.dropout_keep.default  # defined by ratex.core.random


listeners = metrics._listeners  # non-empty while a profiler (or RATEX_PROFILE) listens to timed events


def tell(name: str, start: float, end: float):
    """Tell the listeners about a span (the profiler's 'Sync': time inside ratex), keeping no metric."""
    for fn in tuple(metrics._listeners):
        fn(name, start, end)


def param_aliasing() -> bool:
    """Return whether ENABLE_PARAM_ALIASING asks for in-place updates of overwritten inputs."""
    return config.PARAM_ALIASING


@functools.lru_cache(maxsize=None)
def target(kind: str, cuda_arch: str = ""):
    """Return the tvm_lowering Target for 'CPU', or 'GPU' with its CUDA arch ('sm_90')."""
    return tvm_lowering.resolve_target(kind) if kind == "CPU" else tvm_lowering.resolve_target(kind, cuda_arch)


def library(kind: str) -> tuple:
    """(whether matmul/conv go to the kernel library, the smallest size sent there) on `kind`.

    On GPU the library must be the Python kernels (torch's CUDA kernels): the native
    library is registered over them only for RATEX_DEVICE=CPU, and it takes CPU tensors only.
    """
    use = executor.use_library(kind)
    if kind == "GPU" and kernels.NATIVE is not None:
        use = False
    return use, executor.library_min_macs(kind)


def memory_cache():
    """Return the lazy path's in-memory compile cache (keys of this front end start with 'dynamo')."""
    return sync._cache


def disk_name(key):
    """Return the persistent-cache entry name of `key`, or None (no cache dir, or a key without a
    process-independent text)."""
    cache = executor._disk_cache()
    if cache is None:
        return None
    return cache.name(key)


def load(name: str, kind: str):
    """Return the library stored as entry `name` of the persistent cache, or None."""
    cache = executor._disk_cache()
    tuner = executor._tuner() if kind == "CPU" else None
    with metrics.timed("PersistentCacheLoadTime"):
        accept = (lambda meta: tuner.is_current(meta.get("kernels"))) if tuner is not None else None
        lib = cache.load(name, accept=accept)
    if lib is not None:
        metrics.counter_inc("PersistentCacheHit")
    return lib


def build(mod, kind: str, cuda_arch: str, donate: tuple, label: str, name, ops: int):
    """Compile Relax module `mod` for `kind`; return (executable or loaded library, donated pairs).

    With a persistent-cache entry `name`, the executable is stored there and loaded back
    (linking it once on export is cheaper than linking it in memory at every load).
    """
    launch.drain()  # no compiling while a lazy program runs: TVM's codegen isn't safe next to it
    use, min_macs = library(kind)
    tuner = executor._tuner() if kind == "CPU" else None
    report = tuning.Report()
    kernel_pass = tuner.pass_(report, executor._tuning) if tuner is not None else None
    donated = []
    with progress.compiling(label), metrics.timed("CompileTime"):
        executable = tvm_lowering.build(mod, target(kind, cuda_arch), library=use, donate=donate, donated=donated,
                                        kernel_pass=kernel_pass, library_min_macs=min_macs)
    if donated:
        metrics.counter_inc("DonatedBuffers", len(donated))
    if report.applied:
        metrics.counter_inc("TunedKernelsApplied", report.applied)
    if name is not None:
        cache = executor._disk_cache()
        with metrics.timed("PersistentCacheStoreTime"):
            try:
                path = cache.store(name, executable, {"ops": ops, "salt": cache.salt, "kernels": report.kernels})
                return tvm.runtime.load_module(path), tuple(donated)
            except Exception as err:  # noqa: BLE001 - a full disk or a missing linker must not fail the step
                _warn_once(f"store:{cache.root}", f"ratex compile cache: could not save to {cache.root}: {err}")
    return executable, tuple(donated)


def lower(graph, kind: str):
    """Return the Relax module of fx `graph` for `kind` (raises tvm_lowering.LoweringError)."""
    use, min_macs = library(kind)
    with metrics.timed("LowerTime"):
        return tvm_lowering.import_graph(graph, library=use, host_kernels=kind == "CPU", library_min_macs=min_macs)


def saving_ir() -> bool:
    """Return whether RATEX_SAVE_IR names a file to append compiled graphs to."""
    return bool(config.SAVE_IR)


def save_ir(text: str):
    """Append `text` to the RATEX_SAVE_IR file."""
    if config.SAVE_IR:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        with open(config.SAVE_IR, "a", encoding="utf-8") as f:
            f.write(f"==== torch.compile graph  compiled {stamp}\n{text}\n")


_warned = set()


def _warn_once(what: str, message: str):
    if what not in _warned:
        _warned.add(what)
        warnings.warn(message, stacklevel=3)


def warn_fallback(name: str, why: str):
    """Warn once per op name that `name` runs in eager PyTorch, and why."""
    _warn_once(f"op:{name}", f"ratex: {name} runs in eager PyTorch ({why}): correct, but slower")
