"""The CUDA pass pipeline: TVM's (tvm.relax.backend.cuda.pipeline), with default schedules that
survive a rule that fails, and CUDA source that compiles where a kernel holds an infinite or NaN
bfloat16 constant.

dlight's GPU rules return None for a kernel they don't fit, and ApplyDefaultSchedule tries the
next one; but some raise instead, which fails the whole build. Reduction does on a full reduction
into a 0-d tensor with an epilogue (`mean` over every axis, so `mse_loss`): "Check failed:
block_realize == old_block_realize_". Here a rule that raises counts as one that does not fit, and
the next (GeneralReduction, then Fallback) schedules the kernel.

A kernel that no rule schedules binds no GPU thread, and TVM's build then leaves it on the host:
it runs on the CPU, reading and writing CUDA memory through device pointers, and the process
dies of SIGSEGV. relax Gradient's `take_backward` (an embedding's gradient in a scripted model,
a serial scatter-add loop) is one. TVM's DefaultGPUSchedule, last, binds each such kernel: its
loops to threads where it can, an opaque body (that scatter) to one thread, slow but right. Where
it cannot (TVM's adaptive pool, with nested blocks), the build fails naming the kernels, and the
lazy path runs the op on PyTorch.

TVM's CUDA codegen prints a bfloat16 constant as `__float2bfloat16_rn(<hexfloat>f)`, which for
inf and NaN is `__float2bfloat16_rn(-inff)`: no such identifier, and NVRTC fails the program
(`x.bfloat16().clamp(min=-inf)`, masks in bfloat16). `_postproc`, TVM's hook on the source before
it is compiled, writes those as the float32 bit patterns instead.

TVM compiles CUDA source with `--use_fast_math` (NVRTC always, nvcc unless
TVM_CUDA_NVCC_NO_FAST_MATH is set). That is not PyTorch's arithmetic: every powf becomes
exp2(y * log2(x)), NaN for a negative base, so `x.pow(3)` of a negative x, GPT-2's gelu and
T5's `pow(2).mean()` gave NaN; sinf, expf and logf become their approximate intrinsics,
division and sqrt approximate, denormals flushed to zero. `compile_cuda` (TVM's compile hook)
compiles with TVM's NVRTC path, the flag taken out of its options.
"""
import re
import threading

import tvm
from tvm.relax.backend.cuda import pipeline as _tvm
from tvm.support import nvcc as _nvcc  # registers TVM's compile hook, which compile_cuda replaces below
from tvm import s_tir
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
    """Return TVM's legalization passes for CUDA, each default-schedule rule made `Tolerant`, then
    TVM's DefaultGPUSchedule for the kernels no rule scheduled (see the module doc)."""
    passes = [dl.ApplyDefaultSchedule(*(Tolerant(r) for r in p.rules)) if p.info.name == "ApplyDefaultSchedule" else p
              for p in _tvm.legalize_passes(target)]
    return passes + [bind_unbound_kernels]


def _binds_threads(func) -> bool:
    text = str(func)  # (TVM exposes no TIR visitor to Python)
    return "T.thread_binding(" in text or "T.launch_thread(" in text or '"thread_extent"' in text


@tvm.transform.module_pass(opt_level=0, name="RatexBindUnboundKernels")
def bind_unbound_kernels(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Give TVM's DefaultGPUSchedule the kernels that bind no GPU thread (those alone: it would
    wrap a kernel that binds some of its loops in a launch of its own)."""
    unbound = {gv: f for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc) and not _binds_threads(f)}
    if not unbound:
        return mod
    try:
        bound = s_tir.transform.DefaultGPUSchedule()(tvm.IRModule(unbound))
    except Exception as e:  # noqa: BLE001 - TVM's errors; the build fails with the kernels named
        names = ", ".join(sorted(gv.name_hint for gv in unbound))
        raise RuntimeError(f"kernels {names} bind no GPU thread, and TVM's DefaultGPUSchedule cannot "
                           f"schedule them ({str(e).strip().splitlines()[-1]})") from e
    for gv in unbound:
        mod[gv] = bound[gv.name_hint]
    return mod


_BF16_SPECIAL = re.compile(r"__float2bfloat16_rn\((-?)(inf|nan)f/\*[^*]*\*/\)")
_BITS = {"inf": "0x7f800000", "nan": "0x7fc00000"}


def fix_bfloat16_constants(code: str) -> str:
    """Return CUDA source `code` with TVM's spelling of infinite and NaN bfloat16 constants made valid."""
    return _BF16_SPECIAL.sub(lambda m: f"__float2bfloat16_rn({m.group(1)}__int_as_float({_BITS[m.group(2)]}))", code)


def _install_postproc():
    """Put `fix_bfloat16_constants` in TVM's source hook (once: this module is imported once), after
    whatever hook was there."""
    name = "tvm_callback_cuda_postproc"
    previous = tvm.get_global_func(name, allow_missing=True)

    def postproc(code, target):
        return fix_bfloat16_constants(str(previous(code, target)) if previous is not None else str(code))

    tvm.register_global_func(name, postproc, override=True)


_install_postproc()

_FAST_MATH = b"--use_fast_math"
_NVRTC_LOCK = threading.Lock()


def _compile_nvrtc_precise(code: str) -> bytes:
    """TVM's NVRTC compile of `code` with `--use_fast_math` taken out of its options (TVM's
    function adds it unconditionally; its NVRTC module is looked up at each call)."""
    from cuda.bindings import nvrtc

    original = nvrtc.nvrtcCompileProgram

    def precise(prog, count, options):
        options = [o for o in options if o != _FAST_MATH]
        return original(prog, len(options), options)

    with _NVRTC_LOCK:
        nvrtc.nvrtcCompileProgram = precise
        try:
            return _nvcc.compile_cuda(code, target_format="cubin", compiler="nvrtc")
        finally:
            nvrtc.nvrtcCompileProgram = original


def compile_cuda(code: str, target=None) -> bytes:
    """Compile CUDA source `code` with NVRTC, as TVM's `tvm_callback_cuda_compile` does, but without
    fast math (`target`, which TVM's C++ side passes, is also the current target)."""
    try:
        return _compile_nvrtc_precise(code)
    except ImportError as e:
        raise RuntimeError("compiling CUDA kernels needs NVRTC from cuda-python (pip install cuda-bindings, "
                           f"the build matching your CUDA): {e}") from e


tvm.register_global_func("tvm_callback_cuda_compile", compile_cuda, override=True)
