"""Compiled programs: lower a cut to Relax, compile it, run it on device data."""
import contextlib
import hashlib
import os
import time
import warnings

import torch
import tvm
from tvm import relax

import tvm_lowering
from tvm_lowering import disk_cache, tuning
from tvm_lowering.library_dispatch import AUTO_MIN_MACS
from .. import config
from ..version import __version__
from . import kernels  # noqa: F401  (registers the ratex.lib.* kernel library)
from . import metrics, progress
from .device import backend
from .graph import Graph, to_fx
from .render import format_graph


class Program:
    """One compiled graph: a Relax VM function taking leaves, returning roots.

    `donate`: the (input, output) pairs whose output may be written into the
    input's buffer (ENABLE_PARAM_ALIASING; see tvm_lowering/inplace.py).
    """

    __slots__ = ("fn", "vm", "mod", "executable", "donate", "constant", "label", "empty", "_launcher")

    def __init__(self, executable, mod, device, donate=(), constant=()):
        """`executable`: a VMExecutable, or a runtime module loaded from the disk cache (mod None).

        `constant`: outputs computed from no input (see `constant_roots`)."""
        self.vm = relax.VirtualMachine(executable, device)
        self.fn = self.vm["main"]
        self.mod = mod
        self.executable = executable
        self.donate = frozenset(donate)
        self.constant = tuple(constant)
        self.label = None  # how errors name the graph (sync.py sets it at the first launch)
        self.empty = None  # whether an input has no elements (shapes are fixed: sync sets it at the first launch)
        self._launcher = None  # (PARAM_ALIASING, launcher or None) once launcher() was asked

    def launcher(self):
        """This program's launcher on the native runner (csrc/runner.cc), or None where it runs
        on the Python executor thread: see `native_launcher`."""
        made = self._launcher
        if made is None or made[0] != config.PARAM_ALIASING:  # (tests flip the flag at run time)
            made = self._launcher = (config.PARAM_ALIASING, self.native_launcher(self.fn))
        return made[1]

    def native_launcher(self, fn):
        """A launcher that runs `fn` (this program's function, or one standing in for it) on the
        native runner, with this program's buffer rules (see `run`); None without the native
        library (or with RATEX_NATIVE_RUNNER=false), on GPU, or with an input without elements
        (TVM may not take its DLPack strides as compact). `empty` must be known (sync sets it
        from the graph's leaves)."""
        prepare = tvm.get_global_func("ratex.runner.prepare", allow_missing=True) if config.NATIVE_RUNNER else None
        if prepare is None or backend().kind != "CPU" or self.empty is not False:
            return None
        donate = [k for pair in sorted(self.donate) for k in pair]
        return prepare(fn, config.PARAM_ALIASING, donate, list(self.constant))

    def run(self, inputs: list) -> list:
        """Run on device data `inputs`; return device data, one per root."""
        be = backend()
        outs = be.call(self.fn, inputs, self.empty)
        if config.PARAM_ALIASING:
            for j in self.constant:  # a folded constant: the same buffer every run; donating it would change it
                outs[j] = be.copy(outs[j])
            _own_buffers(be, inputs, outs, self.donate)
        return outs


def constant_roots(graph: Graph) -> tuple:
    """Positions of the roots that depend on no input (factories like torch.zeros).

    TVM folds them into constants, which the program returns as the same buffer on
    every run: such an output must not be donated to a later in-place update
    (a `total = torch.zeros(()); total += loss` accumulator once corrupted the
    program's zero that way).
    """
    leaves = {(id(node), idx) for node, idx in graph.leaves}
    fed = set()  # ids of nodes that read some input
    for node in graph.nodes:
        if any((id(n), i) in leaves or id(n) in fed for n, i in node.inputs):
            fed.add(id(node))
    return tuple(j for j, (node, _) in enumerate(graph.roots) if id(node) not in fed)


def _own_buffers(be, inputs: list, outs: list, donate: frozenset):
    """Give each output a buffer of its own, except where it was donated its input's.

    A program may return an input, or one buffer twice (identities, reshapes
    that became views). With donation on, a later step writes into the buffer
    of a value it overwrites, which must then belong to that value alone.
    """
    owner = {}
    for i, x in enumerate(inputs):
        if x.numel():
            owner.setdefault(x.data_ptr(), i)
    for j, out in enumerate(outs):
        if not out.numel():
            continue
        ptr = out.data_ptr()
        who = owner.get(ptr)
        if who is None or (type(who) is int and (who, j) in donate):
            owner[ptr] = ("out", j)
        else:
            outs[j] = be.copy(out)
            metrics.counter_inc("AliasedOutputCopy")


def use_library(kind: str) -> bool:
    """Whether matmul/conv go to the kernel library (ratex/core/kernels.py) on this target:
    PyTorch's CPU kernels on CPU; on GPU its CUDA kernels (cuBLAS, cuDNN), where this torch
    has CUDA."""
    if config.KERNELS not in ("AUTO", "LIBRARY"):
        return False
    return kind == "CPU" or torch.cuda.is_available()


def library_min_macs(kind: str) -> int:
    """The smallest matmul/conv (multiply-adds) sent to the library: `auto` keeps small ones
    as TVM code on CPU (see tvm_lowering/library_dispatch.py AUTO_MIN_MACS), `library` sends all.
    On GPU `auto` sends all too: TVM's default CUDA schedule for a convolution is a plain loop
    nest per thread (LeNet-5 b64's step ran 3-4x eager CUDA's), and small sizes were not measured apart."""
    return AUTO_MIN_MACS if config.KERNELS == "AUTO" and kind == "CPU" else 0


def compile_graph(graph: Graph, donate=()) -> Program:
    """Lower and compile `graph` for the configured target (raises LoweringError).

    `donate`: (leaf, root) index pairs where the root is the new value of the
    leaf's tensor, so the update may be written into the leaf's buffer.
    """
    with progress.compiling(f"a graph of {len(graph.nodes)} ops"):
        return _compile(graph, tuple(donate))


def _compile(graph: Graph, donate: tuple) -> Program:
    be = backend()
    with metrics.timed("LowerTime"):
        library = use_library(be.target.kind)
        min_macs = library_min_macs(be.target.kind)
        mod = tvm_lowering.import_graph(
            to_fx(graph), library=library, host_kernels=be.target.kind == "CPU", library_min_macs=min_macs
        )
    cache = _disk_cache()
    name = _entry_name(cache, cache_key(graph, donate)) if cache is not None else None
    dev = be.target.device()
    donated = []
    tuner = _tuner()
    report = tuning.Report()
    kernel_pass = tuner.pass_(report, _tuning) if tuner is not None else None
    with metrics.timed("CompileTime"):
        executable = tvm_lowering.build(
            mod, be.target, library=library, donate=donate, donated=donated, kernel_pass=kernel_pass,
            library_min_macs=min_macs,
        )
        # Making the VM JIT-links the code in memory, which costs about as much as the build.
        # With a persistent cache the library is exported (linked) once and loaded instead.
        program = Program(executable, mod, dev, donate, constant_roots(graph)) if name is None else None
    if donated:
        metrics.counter_inc("DonatedBuffers", len(donated))
    if config.SAVE_IR:
        _save_ir(graph, mod, donated)
    if report.applied:
        metrics.counter_inc("TunedKernelsApplied", report.applied)
    if program is None:
        lib = _store(cache, name, graph, executable, report.kernels)
        program = Program(lib if lib is not None else executable, mod, dev, donate, constant_roots(graph))
    return program


def cache_key(graph: Graph, donate: tuple):
    """The compile-cache key of `graph` compiled with donations `donate` (ENABLE_PARAM_ALIASING)."""
    return ("aliasing", graph.key, donate) if config.PARAM_ALIASING else graph.key


def graph_hash(graph: Graph) -> str:
    """Return a short hash of the graph key, the same in every process where possible."""
    try:
        text = disk_cache.stable_text(graph.key)
    except disk_cache.UnstableKey:
        text = repr(graph.key)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _origins(graph: Graph) -> str:
    """The user code lines that recorded the graph's roots, most recent call last."""
    lines = []
    for node, _ in graph.roots:
        for line in node.origin or ():
            if line not in lines:
                lines.append(line)
    return "\n".join(f"  {line}" for line in lines) or "  (unknown)"


def _save_ir(graph: Graph, mod, donated):
    text = (
        f"==== graph {graph_hash(graph)}  compiled {time.strftime('%Y-%m-%d %H:%M:%S')}"
        f"  ({len(graph.nodes)} ops, {len(graph.leaves)} inputs, {len(graph.roots)} outputs)\n"
        f"-- created by\n{_origins(graph)}\n"
        + (f"-- donated buffers (input -> output): {donated}\n" if donated else "")
        + f"-- lazy IR\n{format_graph(graph)}\n-- Relax\n{mod.script()}\n"
    )
    with open(config.SAVE_IR, "a", encoding="utf-8") as f:
        f.write(text)


# ---- persistent cache (RATEX_CACHE_DIR) --------------------------------------------
_disk = {}  # (dir, size limit) -> DiskCache
_last_name = (None, None)  # (graph key, entry name): a miss looks the name up twice


def _disk_cache():
    root = config.CACHE_DIR
    if not root:
        return None
    limit = config.CACHE_SIZE_MB << 20
    cache = _disk.get((root, limit))
    if cache is None:
        here = os.path.dirname(os.path.abspath(__file__))
        code = disk_cache.code_fingerprint([
            os.path.dirname(os.path.abspath(tvm_lowering.__file__)),
            os.path.join(here, "graph.py"),
            os.path.join(here, "ir.py"),
            os.path.join(here, "kernels.py"),
            os.path.join(here, "executor.py"),
            os.path.join(os.path.dirname(here), "jit.py"),
        ])
        be = backend()
        salt = "|".join([
            f"tvm={tvm.__version__}", f"target={be.target.key}", f"ratex={__version__}",
            f"code={code}", f"aliasing={config.PARAM_ALIASING}", f"kernels={getattr(config, 'KERNELS', None)}",
            f"cpu_schedule={os.environ.get('RATEX_CPU_SCHEDULE', '1')}",
        ])
        cache = _disk[(root, limit)] = disk_cache.DiskCache(root, limit, salt)
    return cache


# ---- tuning (RATEX_TUNE) --------------------------------------------------------------
_tuners = {}  # (cache dir, target key, trials) -> tuning.Tuner


def _tuner():
    """The tuning database of this target inside the cache dir (None when the disk cache is off)."""
    root = config.CACHE_DIR
    if not root or backend().target.kind != "CPU":
        return None
    target = backend().target
    key = (root, target.key, config.TUNE)
    tuner = _tuners.get(key)
    if tuner is None:
        # Records are replayed schedules: they are only good for the TVM and target that made them.
        tag = hashlib.sha256(f"{tvm.__version__}|{target.key}".encode()).hexdigest()[:16]
        tuner = _tuners[key] = tuning.Tuner(os.path.join(root, "tuning", tag), target.tvm, config.TUNE)
    return tuner


@contextlib.contextmanager
def _tuning(count: int):
    """Around tuning `count` new kernels during a compile: progress bar, metrics."""
    with metrics.timed("TuneTime"), progress.tuning(count) as step:
        yield step
    metrics.counter_inc("TunedKernels", count)


def _entry_name(cache, key):
    global _last_name
    if _last_name[0] is key:
        return _last_name[1]
    name = cache.name(key)
    _last_name = (key, name)
    return name


def load_program(graph: Graph, donate=()):
    """Return the program of `graph` (compiled with donations `donate`) from the persistent cache, or None."""
    cache = _disk_cache()
    if cache is None:
        return None
    name = _entry_name(cache, cache_key(graph, tuple(donate)))
    if name is None:
        return None
    tuner = _tuner()
    with metrics.timed("PersistentCacheLoadTime"):
        # An entry compiled before its kernels were tuned (or retuned) must not shadow a tuned program.
        accept = (lambda meta: tuner.is_current(meta.get("kernels"))) if tuner is not None else None
        lib = cache.load(name, accept=accept)
        if lib is None:
            return None
        program = Program(lib, None, backend().target.device(), donate, constant_roots(graph))
    metrics.counter_inc("PersistentCacheHit")
    return program


def _store(cache, name, graph: Graph, executable, records):
    """Save a fresh executable as entry `name`; return the library loaded back, or None on failure.

    `records` (workload hash -> tuning record fingerprint) lets a later load
    tell whether the tuning database has changed for this program's kernels.
    """
    with metrics.timed("PersistentCacheStoreTime"):
        try:
            info = {"ops": len(graph.nodes), "salt": cache.salt, "kernels": records}
            path = cache.store(name, executable, info)
            return tvm.runtime.load_module(path)
        except Exception as err:  # noqa: BLE001 - a full disk or a missing linker must not fail the step
            if cache.root not in _store_warned:
                _store_warned.add(cache.root)
                warnings.warn(f"ratex compile cache: could not save to {cache.root}: {err}", stacklevel=3)
            return None


_store_warned = set()

