"""Targets and the pass pipeline that turns a Relax module into an executable."""
import dataclasses
import os
import functools

import tvm
from tvm import relax

from . import fastmath, inplace, pool_grad
from .library_dispatch import library_dispatch_pass
from .simplify import expand_attention, fold_transposes
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
        # Reassociation lets LLVM vectorize float reductions (a 1024x1024 row sum and layer_norm
        # went from 3-4x torch's time to 1.0x) at the cost of a different summation order, as
        # torch's own vectorized kernels have; contraction allows FMAs. No nnan/ninf: NaN and
        # inf must propagate as PyTorch's do.
        fast_math = {"fast-math-reassoc": True, "fast-math-contract": True}
        return Target("CPU", tvm.target.Target({"kind": "llvm", "mcpu": _host_cpu(), **fast_math}))
    if kind == "GPU":
        return Target("GPU", tvm.target.Target({"kind": "cuda", "arch": cuda_arch}))
    raise ValueError(f"unknown device {kind!r}; valid values: {', '.join(DEVICES)}")


def _host_cpu() -> str:
    return str(tvm.target.codegen.llvm_get_system_cpu()) if hasattr(tvm.target, "codegen") else "generic"


def _stages(target: Target, donate=(), donated=None, kernel_pass=None) -> list:
    """TVM's pipeline for the target, plus ratex's CPU schedules, tuning (`kernel_pass`, see
    tuning.py: it schedules kernels right after FuseTIR, before the default schedules) and
    buffer donation (see inplace.py)."""
    if target.kind == "CPU":
        from tvm.relax.backend.cpu_generic import pipeline as stages
    else:
        from tvm.relax.backend.cuda import pipeline as stages
    legalize = stages.legalize_passes(target.tvm)
    # On both targets: relu that keeps NaN, max-pool gradients as a gather (TVM's own rule is a
    # scatter that the CUDA pipeline's default schedules reject). On CPU also exp that vectorizes.
    # TVM's rules for the rest.
    rules = {**(fastmath.LEGALIZE if target.kind == "CPU" else fastmath.EXACT), **pool_grad.LEGALIZE}
    legalize.insert(0, relax.transform.LegalizeOps(rules))
    if kernel_pass is not None:
        legalize.append(kernel_pass)
    if target.kind == "CPU" and os.environ.get("RATEX_CPU_SCHEDULE", "1") != "0":
        legalize.append(cpu_schedule())
    if donate:  # after fusion and scheduling: each op is a call_tir whose PrimFunc is final
        legalize.append(inplace.donate(donate, donated if donated is not None else []))
    return (
        stages.library_dispatch_passes(target.tvm)
        + legalize
        + stages.dataflow_lower_passes(target.tvm)
        + stages.finalize_passes(target.tvm)
    )


def _passes(target: Target, library: bool, donate=(), donated=None, kernel_pass=None, library_min_macs=0) -> list:
    # CSE removes the forward that a script's backward recomputes (attention's too, once it is
    # expanded); DCE what nothing reads. fold_transposes composes the t(t(x)) chains autograd
    # leaves (simplify.py). The library dispatch folds transposes into matmul calls: DCE drops
    # the transposes after it.
    cleanup = [expand_attention, relax.transform.EliminateCommonSubexpr(), fold_transposes]
    if library:
        cleanup.append(library_dispatch_pass(library_min_macs))
    cleanup.append(relax.transform.DeadCodeElimination())
    return cleanup + _stages(target, donate, donated, kernel_pass)


def build(mod: tvm.IRModule, target: Target, library: bool = False, donate=(), donated=None, kernel_pass=None,
          library_min_macs: int = 0):
    """Compile `mod` with fusion (FuseOps/FuseTIR) for `target`; return a tvm executable.

    With `library`, conv2d/conv2d_transpose/matmul left in the module become
    calls to the ratex.lib.* kernel library (see library_dispatch.py), those
    of fewer than `library_min_macs` multiply-adds excepted.
    `donate`: (input, output) index pairs of `main` where the output may be
    written into the input's buffer; those that were safe are appended to `donated`.
    `kernel_pass` (CPU only): the tuning pass (tuning.py).
    """
    pipeline = tvm.transform.Sequential(_passes(target, library, donate, donated, kernel_pass, library_min_macs))
    with target.tvm:
        return tvm.compile(mod, target=target.tvm, relax_pipeline=pipeline)


def memory_plan(mod: tvm.IRModule, target: Target, library: bool = False, donate=()) -> dict:
    """Bytes that `main` allocates per call once memory is planned, as `build` would compile it.

    'planned': the storage StaticPlanBlockMemory allocates for intermediates;
    'outputs': tensors allocated for outputs (donated ones are not). Inputs and
    buffers that library kernels allocate inside PyTorch are not counted.
    """
    passes = _passes(target, library, donate)
    last = next(k for k, p in enumerate(passes) if p.info.name == "StaticPlanBlockMemory")
    with target.tvm:
        planned = tvm.transform.Sequential(passes[: last + 1])(mod)
    storage, tensor = tvm.ir.Op.get("relax.memory.alloc_storage"), tvm.ir.Op.get("relax.builtin.alloc_tensor")
    sizes = {"planned": 0, "outputs": 0}
    for block in planned["main"].body.blocks:
        for binding in block.bindings:
            call = binding.value
            if not isinstance(call, relax.Call):
                continue
            if call.op.same_as(storage):
                sizes["planned"] += int(call.args[0].values[0])
            elif call.op.same_as(tensor):
                count = 1
                for dim in call.args[0].values:
                    count *= int(dim)
                sizes["outputs"] += count * tvm.runtime.DataType(str(call.args[1].value)).bits // 8
    return sizes
