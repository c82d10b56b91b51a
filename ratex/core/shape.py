"""Shape inference: run the op on meta tensors, memoized on (op, args, input metas).

Errors PyTorch raises for bad shapes come out here, at the op that caused
them, not at mark_step.
"""
import copy
import functools

import torch

from .ir import Meta, fill, op_key

_memo = {}


class NoMeta(Exception):
    """The op has no meta kernel or a data-dependent output shape; run it eagerly instead."""


class Out:
    """The inferred outputs of one op: a flat list of (meta, stride, offset) and the structure.
    `empty`: no output has an element (a None output counts as empty). `key`: the node key
    (ir.Node.key) of every node recorded from this result, one object for all of them."""

    __slots__ = ("metas", "strides", "offsets", "kind", "empty", "key")

    def __init__(self, metas, strides, offsets, kind):
        self.metas, self.strides, self.offsets, self.kind = metas, strides, offsets, kind
        self.empty = all(m is None or 0 in m.shape for m in metas)
        self.key = None


def infer(op, spec, in_metas: tuple) -> Out:
    """Return the outputs of `op` applied to inputs with `in_metas` (shape, stride, dtype)."""
    key = (id(op), spec, in_metas)  # by id: OpOverload.__hash__ is Python code; ATen ops live forever
    hit = _memo.get(key)
    if hit is None:
        hit = _run(op, spec, in_metas)
        if type(hit) is Out:
            # One key object for every node of this op, arguments and input metas, step after
            # step: graph keys made of them compare by identity (graph.replay, the compile cache).
            hit.key = (op_key(op), spec, hit.metas)
        _memo[key] = hit
    if type(hit) is not Out:
        # A copy: raising the memoized exception itself would leave on it the traceback of the
        # latest raise, whose frames hold that call's lazy tensors alive (and pending) for good.
        raise copy.copy(hit)
    return hit


def _run(op, spec, in_metas):
    fakes = [torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in in_metas]
    args, kwargs = fill(spec, fakes)
    if _takes_device(op):
        kwargs["device"] = "meta"
    try:
        out = _OWN.get(id(op), op)(*args, **kwargs)
    except (NotImplementedError, torch._subclasses.fake_tensor.DynamicOutputShapeException) as exc:
        return NoMeta(str(exc))
    except RuntimeError as exc:
        msg = str(exc)
        low = msg.lower()
        if "meta" in low and ("not implemented" in low or "backend" in low or "cannot be called on meta" in low
                              or "a meta tensor" in low):  # repeat_interleave: its size depends on values
            return NoMeta(msg)
        return exc
    if isinstance(out, torch.Tensor):
        return _pack([out], "tensor")
    if isinstance(out, (tuple, list)) and out and all(o is None or isinstance(o, torch.Tensor) for o in out):
        if id(op) in _BATCH_NORMS:
            out = _batch_norm_stats_dtype(out, args)
        return _pack(list(out), "tuple" if isinstance(out, tuple) else "list")
    return NoMeta(f"{op} returns {type(out).__name__}, not tensors")


_aten = torch.ops.aten
_BATCH_NORMS = {id(op) for op in (
    _aten.native_batch_norm.default, _aten._native_batch_norm_legit.default, _aten._native_batch_norm_legit.no_stats,
    _aten._native_batch_norm_legit_no_training.default, _aten._native_batch_norm_legit_functional.default,
    _aten._batch_norm_with_update.default, _aten._batch_norm_no_update.default)}


def _batch_norm_stats_dtype(out, args):
    """The saved mean and inverse std of a float16/bfloat16 batch norm in the dtype CPU PyTorch
    returns them in: float32 where a weight, bias or running statistic is float32, else the
    input's dtype. The meta kernels say float32 either way."""
    x = args[0]
    if x.dtype not in (torch.float16, torch.bfloat16):
        return out
    params = [a for a in args[1:5] if isinstance(a, torch.Tensor)]
    dt = torch.float32 if any(p.dtype == torch.float32 for p in params) else x.dtype
    return type(out)(o.to(dt) if i in (1, 2) and o is not None and o.dtype == torch.float32 else o
                     for i, o in enumerate(out))


def _grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """The output of aten._grouped_mm as its CPU kernel gives it, for operands of any one float
    dtype: torch's meta function, written for CUDA's kernel, wants bfloat16. Its other checks
    stay but one: the kernels' operands need no 16-byte aligned strides (a lazy tensor's strides
    are not its memory's: `x.to("lazy")` of a column-major x is row major). The contraction dims
    must match in the 2D x 2D layout too, where the CPU kernel reads past a shorter one."""
    def check(ok, msg):
        torch._check(ok, lambda: f"_grouped_mm: {msg}")

    dims = mat_a.dim(), mat_b.dim()
    check(set(dims) <= {2, 3}, f"mat_a and mat_b must be 2D or 3D, got {dims[0]}D and {dims[1]}D")
    floats = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    check(mat_a.dtype in floats and mat_b.dtype == mat_a.dtype,
          f"mat_a and mat_b must be of one float dtype, got {mat_a.dtype} and {mat_b.dtype}")
    check(mat_a.size(-1) == mat_b.size(-2),
          f"the contraction dims of mat_a {tuple(mat_a.shape)} and mat_b {tuple(mat_b.shape)} differ")
    if dims == (3, 3):
        check(offs is None, "offs is given for 3D x 3D operands, which need none")
        check(mat_a.size(0) == mat_b.size(0), f"mat_a has {mat_a.size(0)} matrices and mat_b {mat_b.size(0)}")
    else:
        check(offs is not None, f"offs is needed for {dims[0]}D x {dims[1]}D operands")
        check(offs.dim() == 1 and offs.dtype == torch.int32,
              f"offs must be a 1D int32 tensor, got a {offs.dim()}D {offs.dtype} one")
        if dims != (2, 2):
            groups = (mat_b if dims == (2, 3) else mat_a).size(0)
            check(offs.size(0) == groups, f"offs has {offs.size(0)} groups and the 3D operand {groups} matrices")
    check(bias is None, "a bias is not supported")
    check(out_dtype in (None, mat_a.dtype), f"out_dtype {out_dtype} must be mat_a's dtype {mat_a.dtype}")
    if dims == (2, 2):
        size = (offs.size(0), mat_a.size(0), mat_b.size(1))
    elif dims == (3, 2):
        size = (mat_a.size(1), mat_b.size(1))
    else:  # 2D x 3D: (S, N); 3D x 3D: (E, M, N)
        size = (*mat_a.shape[:-1], mat_b.size(-1))
    return mat_a.new_empty(size)


# Ops whose outputs come from these functions instead of their meta kernels.
_OWN = {id(_aten._grouped_mm.default): _grouped_mm}


def _pack(outs, kind):
    """None outputs (e.g. masked-off gradients of convolution_backward) keep a None meta."""
    return Out(
        tuple(None if o is None else Meta(tuple(o.shape), o.dtype) for o in outs),
        tuple(None if o is None else tuple(o.stride()) for o in outs),
        tuple(None if o is None else o.storage_offset() for o in outs),
        kind,
    )


def _takes_device(op) -> bool:
    return any(a.name == "device" for a in op._schema.arguments)


@functools.lru_cache(maxsize=4096)
def contiguous_strides(shape: tuple) -> tuple:
    """Return the strides of a contiguous tensor of `shape`."""
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))
