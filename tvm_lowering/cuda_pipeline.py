"""The CUDA pass pipeline: TVM's (tvm.relax.backend.cuda.pipeline), with default schedules that
survive a rule that fails.

dlight's GPU rules return None for a kernel they don't fit, and ApplyDefaultSchedule tries the
next one; but some raise instead, which fails the whole build. Reduction does on a full reduction
into a 0-d tensor with an epilogue (`mean` over every axis, so `mse_loss`): "Check failed:
block_realize == old_block_realize_". Here a rule that raises counts as one that does not fit, and
the next (GeneralReduction, then Fallback) schedules the kernel.
"""
from tvm.relax.backend.cuda import pipeline as _tvm
from tvm.s_tir import dlight as dl

library_dispatch_passes = _tvm.library_dispatch_passes
dataflow_lower_passes = _tvm.dataflow_lower_passes
finalize_passes = _tvm.finalize_passes


class Tolerant(dl.ScheduleRule):
    """`rule`, returning None (does not fit) where it raises."""

    def __init__(self, rule: dl.ScheduleRule):
        self.rule = rule

    def apply(self, func, target, tunable):
        """Return `rule`'s schedule of `func`, or None where it has none or fails making one."""
        try:
            return self.rule.apply(func, target, tunable)
        except Exception:  # noqa: BLE001 - TVM's InternalError and kin: the next rule gets its turn
            return None


def legalize_passes(target):
    """Return TVM's legalization passes for CUDA, each default-schedule rule made `Tolerant`."""
    return [dl.ApplyDefaultSchedule(*(Tolerant(r) for r in p.rules)) if p.info.name == "ApplyDefaultSchedule" else p
            for p in _tvm.legalize_passes(target)]
