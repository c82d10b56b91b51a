"""Compiled programs: lower a cut to Relax, compile it through the compile cache, run it on device data."""
import contextlib
import functools
import hashlib
import os
import time

import torch
import tvm

import tvm_lowering
from tvm_lowering.cuda_graph import GRAPH_INPUTS
from tvm_lowering import codegen, disk_cache
from .. import config, process
from ..version import __version__
from . import kernels  # noqa: F401  (registers the ratex.lib.* kernel library)
from . import metrics, progress, tvm_log
from .device import backend, stored_dtype
from . import launch
from .launch import Pending
from .graph import Graph, to_fx
from .render import format_graph

# The process's compiled programs: in memory, then in RATEX_CACHE_DIR (see `_attach`).
CACHE = tvm_lowering.CompileCache()
PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # ratex/: its code salts the disk cache


class Program:
    """One compiled graph: a Relax VM function taking leaves, returning roots (and, where the
    graph indexes with tensors, the rows of its index checks after them: see ratex/core/bounds.py).

    `donate`: the (input, output) pairs whose output may be written into the
    input's buffer (see tvm_lowering/inplace.py). `aliasing`: the program runs
    where steps donate buffers (ENABLE_PARAM_ALIASING), so each output must
    own its buffer (see `run`).
    """

    __slots__ = ("fn", "vm", "mod", "executable", "device", "donate", "constant", "aliasing", "label", "empty",
                 "_launcher", "graph_inputs", "_graph_at")

    def __init__(self, executable, mod, device, donate=(), constant=(), aliasing=False):
        """`executable`: a VMExecutable, or a runtime module loaded from the disk cache (mod None).

        `constant`: outputs computed from no input (see `constant_roots`)."""
        self.vm = codegen.virtual_machine(executable, device)
        self.fn = self.vm["main"]
        self.mod = mod
        self.executable = executable
        self.device = device
        # The inputs whose buffers the program's CUDA graphs hold (tvm_lowering/cuda_graph.py), or None
        self.graph_inputs = tuple(self.vm[GRAPH_INPUTS]()) if self.vm.module.implements_function(GRAPH_INPUTS) else None
        self._graph_at = None  # their addresses when the graphs were captured
        self.donate = frozenset(donate)
        self.constant = tuple(constant)
        self.aliasing = aliasing
        self.label = None  # how errors name the graph (sync.py sets it at the first launch)
        self.empty = None  # whether an input has no elements (shapes are fixed: sync sets it at the first launch)
        self._launcher = None  # (launcher or None,) once launcher() was asked

    def launcher(self):
        """This program's launcher on the native runner (csrc/runner.cc), or None where it runs
        on the Python executor thread: see `native_launcher`."""
        made = self._launcher
        if made is None:
            made = self._launcher = (self.native_launcher(self.fn),)
        return made[0]

    def native_launcher(self, fn):
        """A launcher that runs `fn` (this program's function, or one standing in for it) on the
        native runner, with this program's buffer rules (see `run`); None without the native
        library (or with RATEX_NATIVE_RUNNER=false), on a backend without the runner (GPU), or
        with an input without elements (TVM may not take its DLPack strides as compact).
        `empty` must be known (sync sets it from the graph's leaves)."""
        prepare = tvm.get_global_func("ratex.runner.prepare", allow_missing=True) if config.NATIVE_RUNNER else None
        if prepare is None or not backend().native_runner or self.empty is not False:
            return None
        donate = [k for pair in sorted(self.donate) for k in pair]
        return prepare(fn, self.aliasing, donate, list(self.constant))

    def run(self, inputs: list) -> list:
        """Run on device data `inputs`; return device data, one per root (then the index checks, if any)."""
        be = backend()
        if self.graph_inputs is not None:
            self._check_graph_inputs(inputs)
        outs = be.call(self.fn, inputs, self.empty)
        if self.aliasing:
            for j in self.constant:  # a folded constant: the same buffer every run; donating it would change it
                outs[j] = be.copy(outs[j])
            _own_buffers(be, inputs, outs, self.donate)
            launch.reuse_donated(inputs, outs, self.donate)
        return outs

    def _check_graph_inputs(self, inputs: list):
        """Replaying a CUDA graph reads and writes the buffers it was captured with: where an input
        it holds comes in another buffer (a parameter given new data, not updated in place), a
        fresh VM captures the graphs anew."""
        at = tuple(inputs[k].data_ptr() for k in self.graph_inputs)
        if self._graph_at is not None and at != self._graph_at:
            self.vm = codegen.virtual_machine(self.executable, self.device)
            self.fn = self.vm["main"]
            metrics.counter_inc("CudaGraphRecapture")
        self._graph_at = at

    def may_capture(self, inputs: list) -> bool:
        """Whether a run on `inputs` (device data or Pendings) may capture CUDA graphs: the first
        run, or one whose held inputs are not known to be where the graphs hold them. TVM captures
        in global mode on a stream that syncs with the legacy default stream, so nothing else may
        touch the device meanwhile (launch.py runs such a run alone)."""
        if self.graph_inputs is None:
            return False
        if self._graph_at is None:
            return True
        updates = dict(self.donate)  # input -> the output written into its buffer
        for k, at in zip(self.graph_inputs, self._graph_at):
            x = inputs[k]
            if type(x) is Pending:
                if x.job is not None and x.job.program is self and updates.get(k) == x.index:
                    continue  # this program's own in-place update of input k: the buffer it was given
                if x.job is not None:
                    return True  # another program's output, not made yet
                x = x.data
            if x.data_ptr() != at:
                return True
        return False


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


def compile_options(be=None) -> tvm_lowering.Options:
    """Return the compile options of the backend's target (default: the configured one) under the
    current RATEX_KERNELS, RATEX_CPU_SCHEDULE and RATEX_CUDA_GRAPH (read now: tests change them)."""
    be = be if be is not None else backend()
    return be.target.options(config.KERNELS.lower(), be.library_runs, config.CPU_SCHEDULE, config.CUDA_GRAPH)


def cache_key(graph: Graph, donate: tuple, aliasing: bool):
    """The compile-cache key of `graph` compiled with donations `donate`, for steps that donate
    buffers (`aliasing`) or not. Under RATEX_USE_BF16 the same graph (its metas say float32)
    computes in bfloat16: another program, under another key in memory and on disk."""
    key = ("aliasing", graph.key, donate) if aliasing else graph.key
    return ("bf16", key) if config.USE_BF16 else key


def compile_graph(graph: Graph, key, donate=(), aliasing: bool = False) -> Program:
    """Lower and compile `graph` for the configured target (raises LoweringError); return its Program.

    `key`: its `cache_key`, under which it is stored on disk (RATEX_CACHE_DIR).
    `donate`: (leaf, root) index pairs where the root is the new value of the
    leaf's tensor, so the update may be written into the leaf's buffer.
    """
    with progress.compiling(f"a graph of {len(graph.nodes)} ops"), tvm_log.captured():
        return _compile(graph, key, tuple(donate), aliasing)


def _compile(graph: Graph, key, donate: tuple, aliasing: bool) -> Program:
    be = backend()
    options = compile_options(be)
    with metrics.timed("LowerTime"):
        # With index checks: the program's last output tells which indices were out of range
        # (launch.py reads it, bounds.py names them).
        fx = to_fx(graph, float32_as=stored_dtype(torch.float32))  # bfloat16 under RATEX_USE_BF16
        mod = tvm_lowering.import_graph(
            fx, library=options.library, host_kernels=be.target.host_kernels,
            library_min_macs=options.library_min_macs, checks=[],
        )
    _attach(be)
    dev = be.target.device()
    dump = functools.partial(_save_ir, graph) if config.SAVE_IR else None
    # Making the kernels' machine code in memory (JIT) costs about as much as the rest of the
    # build. With a persistent cache the library is exported (linked) once and loaded instead.
    persists = CACHE.persists(key, options)
    with metrics.timed("CompileTime"):
        built = CACHE.build(mod, be.target, options, donate, on_tune=tuning_progress, dump=dump, jit=not persists)
        program = None if persists else Program(built.executable, mod, dev, donate, constant_roots(graph), aliasing)
    record_phases(built)
    if built.donated:
        metrics.counter_inc("DonatedBuffers", len(built.donated))
    if built.report.applied:
        metrics.counter_inc("TunedKernelsApplied", built.report.applied)
    if program is None:
        with metrics.timed("PersistentCacheStoreTime"):
            lib = CACHE.store(key, options, built, {"ops": len(graph.nodes)})
        program = Program(lib if lib is not None else built.executable, mod, dev, donate, constant_roots(graph),
                          aliasing)
    return program


def record_phases(built):
    """Keep the seconds of a compile's pass pipeline and of its code generation as the metrics
    CompilePassesTime and CodegenTime (the two parts of CompileTime's build)."""
    metrics.add_sample("CompilePassesTime", built.seconds["passes"])
    metrics.add_sample("CodegenTime", built.seconds["codegen"])


def load_program(graph: Graph, key, donate=(), aliasing: bool = False):
    """Return the program of `graph` under `key` (its `cache_key`; compiled with donations
    `donate`) from the persistent cache, or None."""
    be = backend()
    _attach(be)
    options = compile_options(be)
    if not CACHE.persists(key, options):
        return None
    with metrics.timed("PersistentCacheLoadTime"):
        lib = CACHE.load(key, options)
        if lib is None:
            return None
        program = Program(lib, None, be.target.device(), donate, constant_roots(graph), aliasing)
    metrics.counter_inc("PersistentCacheHit")
    return program


def _attach(be):
    """Point the cache's disk tier at RATEX_CACHE_DIR, with the tuning settings (read now: tests
    change them); a comparison when nothing changed."""
    CACHE.attach(
        config.CACHE_DIR, be.target, version=__version__, packages=(PACKAGE,), size_limit=config.CACHE_SIZE_MB << 20,
        tune=config.TUNE, cores=process.TVM_THREADS,
    )


@contextlib.contextmanager
def tuning_progress(count: int):
    """Around tuning `count` new kernels during a compile: progress bar, metrics."""
    with metrics.timed("TuneTime"), progress.tuning(count) as step:
        yield step
    metrics.counter_inc("TunedKernels", count)


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
