"""The one place where the compile front end reaches into the lazy path's core.

Everything `ratex.dynamo` shares with the lazy device goes through here: the
compile caches (the lazy path's memory cache object and its persistent
`RATEX_CACHE_DIR` cache), the kernel-library choice, tuning records, metrics,
the RNG seed scheme and the settings. When those move behind new interfaces,
this module is what follows them.
"""
import collections
import functools
import os
import time
import warnings

import torch

import tvm_lowering
from .. import config, process
from ..core import bounds, executor, kernels, launch, metrics, progress, sync, tvm_log
from ..core.tracing import random
from ..version import __version__

counts = metrics.counts  # `counts[name] += 1` on per-call paths
record = metrics.record
add_sample = metrics.add_sample
counter_inc = metrics.counter_inc
new_seed = random.new_seed
DROPOUT_KEEP = torch.ops.ratex.dropout_keep.default  # defined by ratex.core.tracing.random


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
    return tvm_lowering.resolve_target(kind, cuda_arch or None)


def options(kind: str) -> tvm_lowering.Options:
    """The compile options on `kind` under RATEX_KERNELS and RATEX_CPU_SCHEDULE (read now: tests
    change them), as the lazy path resolves them.

    On GPU the library runs where its kernels take CUDA tensors: the Python kernels, or a native
    library built against a torch with CUDA (one built without it takes CPU tensors only).
    Without the library every convolution would be TVM's default CUDA schedule, a plain loop
    nest per thread: LeNet-5 b64's compiled step ran 3-4x slower than eager CUDA's.
    """
    runs = kind == "CPU" or kernels.NATIVE is None or kernels.takes_cuda(kernels.NATIVE)
    return target(kind).options(config.KERNELS.lower(), runs, config.CPU_SCHEDULE)


def memory_cache():
    """Return the lazy path's compile cache (keys of this front end start with 'dynamo')."""
    return executor.CACHE


def _attach(kind: str, cuda_arch: str):
    """Point the cache's disk tier at RATEX_CACHE_DIR for this target, as the lazy path does."""
    executor.CACHE.attach(
        config.CACHE_DIR, target(kind, cuda_arch), version=__version__, packages=(executor.PACKAGE,),
        size_limit=config.CACHE_SIZE_MB << 20, tune=config.TUNE if kind == "CPU" else 0,
        cores=process.TVM_THREADS,
    )


def load(key, kind: str, cuda_arch: str):
    """Return the library stored under `key` in the persistent cache, or None."""
    _attach(kind, cuda_arch)
    opts = options(kind)
    if not executor.CACHE.persists(key, opts):
        return None
    with metrics.timed("PersistentCacheLoadTime"):
        lib = executor.CACHE.load(key, opts)
    if lib is not None:
        metrics.counter_inc("PersistentCacheHit")
    return lib


def build(mod, kind: str, cuda_arch: str, donate: tuple, label: str, key, ops: int):
    """Compile Relax module `mod` for `kind`; return (executable or loaded library, donated pairs).

    With a persistent cache and a `key`, the executable is stored there and loaded back
    (linking it once on export is cheaper than linking it in memory at every load).
    """
    launch.drain()  # no compiling while a lazy program runs: TVM's codegen isn't safe next to it
    _attach(kind, cuda_arch)
    opts = options(kind)
    persists = key is not None and executor.CACHE.persists(key, opts)
    with progress.compiling(label), metrics.timed("CompileTime"), tvm_log.captured():
        built = executor.CACHE.build(mod, target(kind, cuda_arch), opts, donate, on_tune=executor.tuning_progress,
                                     jit=not persists)
    executor.record_phases(built)
    if built.donated:
        metrics.counter_inc("DonatedBuffers", len(built.donated))
    if built.report.applied:
        metrics.counter_inc("TunedKernelsApplied", built.report.applied)
    if persists:
        with metrics.timed("PersistentCacheStoreTime"):
            lib = executor.CACHE.store(key, opts, built, {"ops": ops})
        if lib is not None:
            return lib, built.donated
    return built.executable, built.donated


def lower(graph, kind: str):
    """Return the Relax module of fx `graph` for `kind` (raises tvm_lowering.LoweringError); where
    it indexes with tensors, its last output holds the index checks (see `check_indices`)."""
    opts = options(kind)
    with metrics.timed("LowerTime"), tvm_log.captured():
        return tvm_lowering.import_graph(graph, library=opts.library, host_kernels=target(kind).host_kernels,
                                         library_min_macs=opts.library_min_macs, checks=[])


def check_indices(rows: torch.Tensor, nodes: list, late: bool = False):
    """Raise IndexError (ratex's IndexOutOfRange) where the check rows `rows` that a program
    returned found an index out of range, naming the op among fx `nodes` (a node's position is
    its meta[SITE]) and the user's line that dynamo recorded for it. `late`: the rows are those
    of an earlier call, read after it returned (`check_indices_later`)."""
    def describe(site, sub):
        node = nodes[site] if 0 <= site < len(nodes) else None
        if node is None:
            return "an indexing op", "at an unknown line"
        frames = [ln.strip() for ln in (node.meta.get("stack_trace") or "").splitlines() if ln.strip().startswith("File ")]
        return str(node.target), frames[-1] if frames else "at an unknown line"

    text = bounds.message(rows.cpu().numpy(), describe)
    if text is not None:
        note = (" (found after the program that met it returned: CUDA programs run asynchronously, as eager's CUDA "
                "kernels do; CUDA_LAUNCH_BLOCKING=1 raises at its call)") if late else ""
        raise launch.IndexOutOfRange(text, f"ratex: {text}{note}")


# Index checks of CUDA programs, not yet read: (event recorded after the rows' copy to the host,
# the host rows, the region's nodes), oldest first. Reading the rows at the call would wait for
# the program's kernels, and the host could not launch the next program while the GPU runs this
# one (two waits a step for a model with a loss over class indices: forward and backward).
deferred = collections.deque()
_MOST_DEFERRED = 8  # more unread than this: wait for the oldest, so an error surfaces within a few steps


def check_indices_later(rows: torch.Tensor, nodes: list):
    """Check the CUDA rows `rows` once their copy to the host lands (`read_checks`, at the next
    program call, or `lm.wait_device_ops()`), as a device-side assert of eager CUDA surfaces at a
    later call; at once where CUDA_LAUNCH_BLOCKING=1 asks for errors at the call that makes them."""
    if _launch_blocking():
        return check_indices(rows, nodes)
    host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)  # torch's host cache reuses it
    host.copy_(rows, non_blocking=True)
    landed = torch.cuda.Event()
    landed.record()
    deferred.append((landed, host, nodes))
    if len(deferred) > _MOST_DEFERRED:
        read_checks(wait=True)


def read_checks(wait: bool = False, every: bool = False):
    """Read the deferred checks whose rows have landed, oldest first, raising IndexError for the
    first that found an index out of range; `wait`: wait for the oldest; `every`: for all."""
    while deferred:
        landed, host, nodes = deferred[0]
        if not landed.query():
            if not (wait or every):
                return
            landed.synchronize()
        wait = False
        deferred.popleft()
        check_indices(host, nodes, late=True)


sync.waiters.append(lambda: read_checks(every=True))


def _launch_blocking() -> bool:
    return os.environ.get("CUDA_LAUNCH_BLOCKING", "0") not in ("", "0")


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
