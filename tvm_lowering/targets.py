"""Compile targets: everything that differs between CPU and CUDA on the compile side, one registration each.

A `Target` names TVM's target, its pass pipeline, the legalization rules ratex
puts in front of TVM's, ratex's own schedules (if the target has them), whether
MetaSchedule tuning applies, and its library-kernel policy. Targets are
registered by name (the values of RATEX_DEVICE); `resolve_target(name)` makes
one. The runtime side (ratex/core/device.py) registers its data exchange under
the same names.

Settings come in as arguments (`Options`); nothing here reads the environment.
"""
import dataclasses
import functools
import importlib
from typing import Callable, Mapping, Optional

import tvm

from . import concat, fastmath, pool_grad, slices
from .library_dispatch import AUTO_MIN_MACS
from .schedules import cpu_schedule

KERNELS = ("auto", "library", "tvm")  # where matmul and convolution run (RATEX_KERNELS)


@dataclasses.dataclass(frozen=True)
class Options:
    """What a compile does beyond the target's defaults: resolved by `Target.options`."""

    library: bool = False  # heavy ops become ratex.lib.* kernel calls (library_dispatch.py)
    library_min_macs: int = 0  # ... those of at least this many multiply-adds
    schedule: bool = True  # the target's own schedules for TVM-generated kernels, where it has them
    cuda_graph: bool = False  # kernels launched as captured CUDA graphs where safe (cuda_graph.py)


@dataclasses.dataclass(frozen=True, eq=False)
class Target:
    """A compile target. `name` is its registry key; `tvm` the TVM target it maps to."""

    name: str
    tvm: tvm.target.Target
    runtime_device: Callable  # tvm.cpu or tvm.cuda
    pipeline: str  # the module of TVM's pass pipeline for the target
    legalize: Mapping  # op name -> legalization, run before TVM's own rules
    schedule: Optional[Callable] = None  # returns the pass of ratex's schedules; None: TVM's only
    tunable: bool = False  # MetaSchedule tuning (tuning.py) applies to its kernels
    host_kernels: bool = False  # built for the host: rules may emit TIR loops run there (Importer.host_kernels)
    auto_min_macs: int = 0  # under kernels=auto, float products smaller than this stay TVM code
    cuda_graphs: bool = False  # its programs can replay CUDA graphs (Options.cuda_graph)
    fold_constants: bool = True  # TVM's FoldConstant runs (legalize.py folds constant fills either way)

    @property
    def key(self) -> str:
        """Return a string that identifies the generated code's target."""
        return f"{self.name}:{self.tvm}"

    def device(self):
        """Return the TVM runtime device that runs this target's code."""
        return self.runtime_device()

    def stages(self):
        """Return the module of TVM's pass pipeline for this target (imported on first use)."""
        return importlib.import_module(self.pipeline)

    def options(self, kernels: str = "auto", library_runs: bool = True, schedule: bool = True,
                cuda_graph: bool = False) -> Options:
        """Return the compile options for RATEX_KERNELS-style `kernels` ('auto', 'library', 'tvm') where the
        kernel library can run on the device (`library_runs`), with the target's schedules on or off, and
        CUDA graphs where asked for and the target has them."""
        if kernels not in KERNELS:
            raise ValueError(f"kernels={kernels!r} is not valid; use one of: {', '.join(KERNELS)}")
        library = kernels != "tvm" and library_runs
        min_macs = self.auto_min_macs if library and kernels == "auto" else 0
        return Options(library=library, library_min_macs=min_macs, schedule=schedule,
                       cuda_graph=cuda_graph and self.cuda_graphs)


_REGISTRY = {}  # name -> factory(arch) -> Target


def register(name: str):
    """Decorator: register `factory(arch)` as the maker of target `name`; returns the factory."""

    def add(factory):
        _REGISTRY[name] = factory
        return factory

    return add


def names() -> tuple:
    """Return the registered target names, in registration order."""
    return tuple(_REGISTRY)


@functools.lru_cache(maxsize=None)
def resolve_target(name: str, arch: Optional[str] = None) -> Target:
    """Return the Target registered as `name` ('CPU', 'GPU'), for architecture `arch` (None: the
    target's default: the host CPU, sm_90)."""
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ValueError(f"unknown target {name!r}; valid values: {', '.join(names())}")
    return factory(arch)


@register("CPU")
def _cpu(arch: Optional[str]) -> Target:
    # Reassociation lets LLVM vectorize float reductions (a 1024x1024 row sum and layer_norm
    # otherwise run far slower than torch's) at the cost of a different summation order, as
    # torch's own vectorized kernels have; contraction allows FMAs. No nnan/ninf: NaN and
    # inf must propagate as PyTorch's do.
    fast_math = {"fast-math-reassoc": True, "fast-math-contract": True}
    # LLVM's loop vectorizer, if-converting a loop whose loads are conditional (a concat, a
    # slice_scatter: TIR's if_then_else and Select) into AVX-512 masked loads, took an index
    # (i & 7) + 4 for consecutive across the 8-boundary: a slice_scatter fused with a reshape
    # read the wrong elements on AVX-512 CPUs (a Llama's rotary gradients were garbage) and
    # right on AVX2 ones. Such loops stay scalar; ratex's schedules vectorize the rest itself.
    no_if_conversion = {"cl-opt": ["-enable-if-conversion=false"]}
    return Target(
        name="CPU",
        tvm=tvm.target.Target({"kind": "llvm", "mcpu": arch or _host_cpu(), **fast_math, **no_if_conversion}),
        runtime_device=tvm.cpu,
        pipeline="tvm.relax.backend.cpu_generic.pipeline",
        # relu that keeps NaN, exp that vectorizes, max-pool gradients as a gather, concatenations
        # of many tensors as copies, slices tagged to share a kernel across offsets (fastmath.py,
        # pool_grad.py, concat.py, slices.py)
        legalize={**fastmath.LEGALIZE, **pool_grad.LEGALIZE, **concat.LEGALIZE, **slices.LEGALIZE},
        schedule=cpu_schedule,
        tunable=True,
        host_kernels=True,
        # PyTorch's CPU convolution has a fixed cost per call that small ones don't amortize:
        # they run faster as TVM code (library_dispatch.AUTO_MIN_MACS).
        auto_min_macs=AUTO_MIN_MACS,
        # FoldConstant compiles each kernel it folds with LLVM (60 ms or more apiece: half a
        # second for an LSTM step, whose zero initial states feed slices and casts); on the host
        # those few small kernels cost microseconds a step, or nothing fused into their users.
        # GPU programs keep it: a kernel of constants alone would need a schedule there.
        fold_constants=False,
    )


@register("GPU")
def _cuda(arch: Optional[str]) -> Target:
    return Target(
        name="GPU",
        tvm=tvm.target.Target({"kind": "cuda", "arch": arch or "sm_90"}),
        runtime_device=tvm.cuda,
        pipeline="tvm_lowering.cuda_pipeline",  # TVM's, its default schedules tolerant of a failing rule
        # relu that keeps NaN; max-pool gradients as a gather: TVM's own rule is a scatter that
        # the CUDA pipeline's default schedules reject; adaptive average pools of small windows
        # as an elementwise kernel: TVM's nests blocks that no GPU schedule takes.
        legalize={**fastmath.EXACT, **pool_grad.LEGALIZE, **pool_grad.ADAPTIVE},
        # Under kernels=auto every product goes to the library: TVM's default CUDA schedule for a
        # convolution is a plain loop nest per thread (LeNet-5 b64's step runs far slower than
        # eager CUDA's), and no size is known below which TVM's is faster.
        auto_min_macs=0,
        cuda_graphs=True,
    )


def _host_cpu() -> str:
    return str(tvm.target.codegen.llvm_get_system_cpu()) if hasattr(tvm.target, "codegen") else "generic"
