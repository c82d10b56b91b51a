"""Every environment variable ratex reads, parsed once at import so bad values fail early.

One rule for booleans: 1/true/yes/on or 0/false/no/off (any case; empty is
false); anything else raises a ValueError naming the variable, its value and
what would be right. Reading a setting means reading this module's attribute
(tests set them at run time); nothing else in ratex reads the environment, and
tvm_lowering never reads this module: it gets settings as arguments. What
`import ratex` changes in the process (threads, memory) is ratex/process.py.
"""
import os

from tvm_lowering import targets

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _choice(name: str, default: str, valid: tuple) -> str:
    raw = os.environ.get(name, default)
    value = raw.strip().upper()
    if value not in valid:
        raise ValueError(f"{name}={raw!r} is not valid; use one of: {', '.join(valid)}")
    return value


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not valid; use true or false (1/true/yes/on, 0/false/no/off)")


def _cache_dir():
    raw = os.environ.get("RATEX_CACHE_DIR")
    if raw is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "ratex")
    raw = raw.strip()
    return os.path.abspath(os.path.expanduser(raw)) if raw else None  # "" disables the disk cache


def _count(name: str, default, least: int = 1, what: str = "a positive whole number"):
    """The variable as a whole number of at least `least`, or `default` where it is unset or empty."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw)
    except ValueError:
        value = least - 1
    if value < least:
        raise ValueError(f"{name}={raw!r} is not valid; use {what}")
    return value


def _tune_trials() -> int:
    """RATEX_TUNE: MetaSchedule trials per new kernel (0: no tuning); records live in the cache dir."""
    trials = _count("RATEX_TUNE", 0, 0, "a whole number of tuning trials per kernel (0: off)")
    raw = os.environ.get("RATEX_TUNE")
    if trials and not targets.resolve_target(DEVICE).tunable:
        raise ValueError(f"RATEX_TUNE={raw!r}: tuning is for CPU kernels only, but RATEX_DEVICE={DEVICE}")
    if trials and CACHE_DIR is None:
        raise ValueError(
            f"RATEX_TUNE={raw!r} needs a directory for the tuning records, but RATEX_CACHE_DIR is empty "
            "(the persistent cache is disabled); set RATEX_CACHE_DIR to a directory"
        )
    return trials


def _log_level():
    """RATEX_LOG_LEVEL: the level of the "ratex" logger, which then prints to stderr (DEBUG shows
    TVM's compile warnings); None where unset or empty."""
    raw = os.environ.get("RATEX_LOG_LEVEL", "")
    return _choice("RATEX_LOG_LEVEL", raw, ("DEBUG", "INFO", "WARNING", "ERROR")) if raw.strip() else None


def _use_bf16() -> bool:
    """RATEX_USE_BF16, or its alias LTC_USE_BF16 (the LTC documents' name): float32 tensors are
    stored and computed as bfloat16 on the device. Where both are set they must agree."""
    ours, alias = _flag("RATEX_USE_BF16", False), _flag("LTC_USE_BF16", False)
    if "RATEX_USE_BF16" in os.environ and "LTC_USE_BF16" in os.environ and ours != alias:
        raise ValueError(f"RATEX_USE_BF16={os.environ['RATEX_USE_BF16']!r} and LTC_USE_BF16="
                         f"{os.environ['LTC_USE_BF16']!r} disagree; set one of them, or both to the same value")
    return ours or alias


def _cuda_graph() -> bool:
    """RATEX_CUDA_GRAPH: programs replay CUDA graphs, on a target that has them."""
    on = _flag("RATEX_CUDA_GRAPH", False)
    if on and not targets.resolve_target(DEVICE).cuda_graphs:
        raise ValueError(f"RATEX_CUDA_GRAPH={os.environ['RATEX_CUDA_GRAPH']!r}: CUDA graphs are for "
                         f"RATEX_DEVICE=GPU, but RATEX_DEVICE={DEVICE}")
    return on


# ---- the target and how a program is compiled --------------------------------------------
DEVICE = _choice("RATEX_DEVICE", "CPU", targets.names())  # a target registered in tvm_lowering/targets.py
# How heavy ops (matmul, conv) run: TVM-generated code, or the kernel library
# (PyTorch's kernels called from the compiled program). auto = the target's policy.
KERNELS = _choice("RATEX_KERNELS", "AUTO", tuple(k.upper() for k in targets.KERNELS))
# ratex's parallel/vectorized schedules for TVM-generated kernels (targets that have them).
CPU_SCHEDULE = _flag("RATEX_CPU_SCHEDULE", True)
# Buffer donation: at mark_step, a tensor whose new value the step computes gives
# its old buffer to that computation, which writes the update in place where
# tvm_lowering/inplace.py proves it safe (the peak memory of a training step drops
# by about the size of parameters + optimizer state). A donated buffer cannot be
# restored: if the program fails, the tensors that owned donated buffers are not
# rolled back like the others but keep the failed value, so reading them raises
# the step's error again rather than returning a half-updated buffer.
PARAM_ALIASING = _flag("ENABLE_PARAM_ALIASING", False)
# torch_xla's XLA_USE_BF16: float32 tensors keep dtype float32 for the user (reads give float32)
# but their device data are bfloat16 and the programs compute them as bfloat16. Fixed at import:
# device data made under one setting are not valid under the other.
USE_BF16 = _use_bf16()

# ---- how programs run ---------------------------------------------------------------------
# CUDA graphs: a GPU program's kernels that touch only its intermediates and the tensors the step
# updates in place (buffer donation) are captured once and replayed (tvm_lowering/cuda_graph.py).
CUDA_GRAPH = _cuda_graph()
# Programs run on a worker thread, overlapping the tracing of the next step; false runs them inline.
ASYNC = _flag("RATEX_ASYNC", True)
# Compiled CPU programs run on the native runner's thread (csrc/runner.cc), which never takes
# the GIL; false (or no native library) runs them on a Python thread (ratex/core/launch.py).
NATIVE_RUNNER = _flag("RATEX_NATIVE_RUNNER", True)
# Library kernels from the C++ library (csrc/kernels.cc), which never takes the GIL; false (or no
# native library) keeps the Python versions of the same kernels (ratex/core/kernels.py).
NATIVE_KERNELS = _flag("RATEX_NATIVE_KERNELS", True)
# The native kernels run large float32 matmuls on the CPU through oneDNN rather than ATen's
# MKL sgemm (csrc/kernels.cc says when and why); false keeps ATen's for all of them.
ONEDNN_GEMM = _flag("RATEX_ONEDNN_GEMM", True)

# ---- the compile cache ----------------------------------------------------------------------
CACHE_DIR = _cache_dir()  # None: no persistent compile cache
CACHE_SIZE_MB = _count("RATEX_CACHE_SIZE_MB", 1024)
TUNE = _tune_trials()  # 0: apply existing tuning records only

# ---- debugging ------------------------------------------------------------------------------
PROFILE = _flag("RATEX_PROFILE", False)
LOG_LEVEL = _log_level()
SAVE_IR = os.environ.get("RATEX_SAVE_IR") or None
# Each compile after the first prints why it compiled (ratex/core/explain.py): torch_xla's PT_XLA_DEBUG.
DEBUG = _flag("RATEX_DEBUG", False)
# After this many compiles in a process, warn once that RATEX_DEBUG says why (0: never).
WARN_COMPILES = _count("RATEX_WARN_COMPILES", 10, 0, "a whole number of compiles (0: never warn)")

# ---- the process (applied by ratex/process.py, each with its opt-out) -----------------------
NUM_THREADS = _count("RATEX_NUM_THREADS", 0)  # torch's thread count; 0: torch's own choice
SHARE_THREADS = _flag("RATEX_SHARE_THREADS", True)  # TVM's pool gets torch's thread count
TVM_NUM_THREADS = _count("TVM_NUM_THREADS", None, 0, "a whole number")  # TVM's own variable: a count you set wins; None: unset
TVM_POOL_YIELD = _flag("RATEX_TVM_POOL_YIELD", True)  # TVM's idle workers sleep and are not pinned
RETAIN_MEMORY = _flag("RATEX_RETAIN_MEMORY", True)  # glibc keeps freed memory for the next step
TORCH_LAZY_STEP = _flag("RATEX_TORCH_LAZY_STEP", True)  # torch._lazy.mark_step drives ratex
GC_FREEZE = _flag("RATEX_GC_FREEZE", True)  # after warm-up, what is alive leaves the cyclic GC's scans
