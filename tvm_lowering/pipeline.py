"""Targets and the pass pipeline that turns a Relax module into an executable."""
import dataclasses
import os
import functools

import tvm
from tvm import relax

from .library_dispatch import library_dispatch
from .schedules import cpu_schedule

DEVICES = ("CPU", "GPU")


@dataclasses.dataclass(frozen=True)
class Target:
    """A compile target: `kind` is 'CPU' or 'GPU'; `tvm` the TVM target it maps to."""

    kind: str
    tvm: tvm.target.Target

    @property
    def key(self) -> str:
        """Return a string that identifies the generated code's target."""
        return f"{self.kind}:{self.tvm}"

    def device(self):
        """Return the TVM runtime device that runs this target's code."""
        return tvm.cpu() if self.kind == "CPU" else tvm.cuda()


@functools.lru_cache(maxsize=None)
def resolve_target(kind: str, cuda_arch: str = "sm_90") -> Target:
    """Return the Target for a RATEX_DEVICE value ('CPU' or 'GPU')."""
    if kind == "CPU":
        return Target("CPU", tvm.target.Target({"kind": "llvm", "mcpu": _host_cpu()}))
    if kind == "GPU":
        return Target("GPU", tvm.target.Target({"kind": "cuda", "arch": cuda_arch}))
    raise ValueError(f"unknown device {kind!r}; valid values: {', '.join(DEVICES)}")


def _host_cpu() -> str:
    return str(tvm.target.codegen.llvm_get_system_cpu()) if hasattr(tvm.target, "codegen") else "generic"


def _cpu_pipeline(kernel_pass=None, schedule=True):
    """TVM's CPU pipeline; `kernel_pass` (tuning) and then ratex's schedules run on the fused kernels."""
    from tvm.relax.backend.cpu_generic import pipeline as cpu
    return (
        cpu.library_dispatch_passes(None)
        + cpu.legalize_passes(None)
        + ([kernel_pass] if kernel_pass is not None else [])
        + ([cpu_schedule()] if schedule else [])
        + cpu.dataflow_lower_passes(None)
        + cpu.finalize_passes(None)
    )


def build(mod: tvm.IRModule, target: Target, library: bool = False, kernel_pass=None):
    """Compile `mod` with fusion (FuseOps/FuseTIR) for `target`; return a tvm executable.

    With `library`, conv2d/conv2d_transpose/matmul left in the module become
    calls to the ratex.lib.* kernel library (see library_dispatch.py).
    `kernel_pass` (CPU only) runs on the module right after FuseTIR, before the
    default schedules: the tuning pass (tuning.py) schedules kernels there.
    """
    # CSE removes the forward that a script's backward recomputes; DCE what nothing reads.
    cleanup = [relax.transform.EliminateCommonSubexpr(), relax.transform.DeadCodeElimination()]
    if library:
        cleanup.append(library_dispatch)
    if target.kind == "CPU":
        schedule = os.environ.get("RATEX_CPU_SCHEDULE", "1") != "0"
        pipeline = tvm.transform.Sequential(cleanup + _cpu_pipeline(kernel_pass, schedule))
    else:
        pipeline = tvm.transform.Sequential(cleanup + [relax.get_default_pipeline(target.tvm)])
    with target.tvm:
        return tvm.compile(mod, target=target.tvm, relax_pipeline=pipeline)
