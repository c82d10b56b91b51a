"""The pass pipeline that turns a Relax module into an executable for a target (targets.py)."""
import time

import tvm
from tvm import relax

from . import codegen, cuda_graph, inplace, once
from .fused_indices import guard_fused_indices
from .legalize import legalize_ops
from .library_dispatch import library_dispatch_pass
from .simplify import drop_dead_bindings, expand_attention, fold_transposes
from .slices import share_slices
from .sums import join_sums
from .targets import Options, Target, resolve_target  # noqa: F401  (resolve_target: imported from here too)


def _stages(target: Target, options: Options, donate=(), donated=None, kernel_pass=None) -> list:
    """TVM's pipeline for the target, with the target's legalization rules first, then tuning
    (`kernel_pass`, see tuning.py: it schedules kernels right after FuseTIR, before the default
    schedules), the target's own schedules (each distinct kernel's made once: once.py), buffer donation (see inplace.py) and, with
    `options.cuda_graph`, CUDA graphs (see cuda_graph.py)."""
    stages = target.stages()
    donated = donated if donated is not None else []
    legalize = stages.legalize_passes(target.tvm)
    if not target.fold_constants:
        legalize = [p for p in legalize if p.info.name != "FoldConstant"]
    legalize.insert(0, legalize_ops(target.legalize))
    legalize.append(share_slices)  # after fusion: the slices left on their own (slices.py)
    if kernel_pass is not None:
        legalize.append(kernel_pass)
    if options.schedule and target.schedule is not None:
        legalize.append(once.SCHEDULES.wrap(target.schedule(), target.name))
    legalize.append(guard_fused_indices)  # after every schedule: indices TVM would flatten wrong (fused_indices.py)
    if donate:  # after fusion and scheduling: each op is a call_tir whose PrimFunc is final
        legalize.append(inplace.donate(donate, donated))
    finalize = stages.finalize_passes(target.tvm)
    if options.cuda_graph:
        place, capture = cuda_graph.passes(donated)
        legalize.append(place)
        # TVM's rewrite needs the planned memory; it runs in place of the pipeline's own (which
        # does nothing without the pass config) so that it is undone where it would be unsafe.
        planned = next(k for k, p in enumerate(finalize) if p.info.name == "StaticPlanBlockMemory")
        finalize.insert(planned + 1, capture)
    return (
        stages.library_dispatch_passes(target.tvm)
        + legalize
        + stages.dataflow_lower_passes(target.tvm)
        + finalize
    )


def _passes(target: Target, options: Options, donate=(), donated=None, kernel_pass=None) -> list:
    # CSE removes the forward that a script's backward recomputes (attention's too, once it is
    # expanded); DCE what nothing reads. fold_transposes composes the t(t(x)) chains autograd
    # leaves (simplify.py). join_sums makes a gradient's sum of small products over an RNN's
    # steps one product (sums.py). The library dispatch folds transposes into matmul calls: DCE
    # drops the transposes after it.
    cleanup = [expand_attention, relax.transform.EliminateCommonSubexpr(), fold_transposes, join_sums]
    if options.library:
        cleanup.append(library_dispatch_pass(options.library_min_macs))
    cleanup.append(drop_dead_bindings)
    return cleanup + _stages(target, options, donate, donated, kernel_pass)


def build(mod: tvm.IRModule, target: Target, options: Options = Options(), donate=(), donated=None,
          kernel_pass=None, jit: bool = True, seconds: dict = None):
    """Compile `mod` with fusion (FuseOps/FuseTIR) for `target`; return a tvm executable.

    With `options.library`, conv2d/conv2d_transpose/matmul left in the module
    become calls to the ratex.lib.* kernel library (see library_dispatch.py),
    those of fewer than `options.library_min_macs` multiply-adds excepted.
    `donate`: (input, output) index pairs of `main` where the output may be
    written into the input's buffer; those that were safe are appended to `donated`.
    `kernel_pass` (tunable targets): the tuning pass (tuning.py). `jit`: the executable will
    run in this process (not be exported), so its kernels' machine code is made now, on the
    threads that build them (codegen.py). `seconds`, where given, gets the wall seconds of the
    pass pipeline ("passes") and of making the kernels' code and linking ("codegen").
    """
    pipeline = tvm.transform.Sequential(_passes(target, options, donate, donated, kernel_pass))
    start = time.perf_counter()
    with target.tvm:
        mod = pipeline(mod)
        passed = time.perf_counter()
        executable = codegen.link(mod, target.tvm, jit)
    if seconds is not None:
        seconds.update(passes=passed - start, codegen=time.perf_counter() - passed)
    return executable


# Passes that schedule kernels: TVM's default GPU schedules, ratex's binding of what they left
# unbound (cuda_pipeline.py), and the target's own schedules (once.py names them Once(...)).
_SCHEDULING = ("ApplyDefaultSchedule", "RatexBindUnboundKernels")


def legalized(mod: tvm.IRModule, target: Target, options: Options = Options(), scheduled: bool = False) -> tvm.IRModule:
    """`mod` through `build`'s passes up to and with its kernels' schedules (`scheduled`) or
    without them (nor tuning records): every kernel fused and named as `build` makes it, its loops
    as its rule wrote them. A scheduled kernel that computes otherwise than its unscheduled self has a schedule or
    code generation bug (scripts/kernel_check.py compares the two, kernel by kernel)."""
    passes = []
    for p in _passes(target, options):
        name = p.info.name
        if name == "RewriteDataflowReshape":  # the first pass past legalization
            break
        if scheduled or (name not in _SCHEDULING and not name.startswith("Once(")):
            passes.append(p)
    with target.tvm:
        return tvm.transform.Sequential(passes)(mod)


def memory_plan(mod: tvm.IRModule, target: Target, options: Options = Options(), donate=()) -> dict:
    """Bytes that `main` allocates per call once memory is planned, as `build` would compile it.

    'planned': the storage StaticPlanBlockMemory allocates for intermediates;
    'outputs': tensors allocated for outputs (donated ones are not). Inputs and
    buffers that library kernels allocate inside PyTorch are not counted.
    """
    passes = _passes(target, options, donate)
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
