"""Mixed precision on the lazy device: `ratex.amp.autocast`, with CUDA autocast's op lists.

    with ratex.amp.autocast(dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)   # matmuls and convolutions in bfloat16, the loss in float32
    loss.backward()

Inside the block, ops on lazy tensors follow torch.autocast('cuda')'s policies, which are the
contract (torch/csrc's autocast_mode.h lists them; an accelerator's autocast, not the CPU's,
which keeps softmax and norms in low precision):
  LOWER     matmul, linear, convolutions, bmm/baddbmm, einsum, RNN cells, attention: their
            floating inputs are cast to `dtype`, and so is the result;
  FP32      exp, log, pow and their kin, layer and group norm, distances, upsampling and
            every loss: run in float32;
  SET_DTYPE softmax, log_softmax, sum, prod, cumsum, cumprod, vector and matrix norms: run
            with dtype=float32 unless the call gives a dtype;
  PROMOTE   addcmul, addcdiv, atan2, dot, index_put, scatter_add and a few more: inputs cast
            to the widest floating dtype among them;
  BANNED    binary_cross_entropy: raises, as on CUDA (use the with-logits form).
Only lazy tensors of float16, bfloat16 or float32 are cast (float64 is left alone, as CUDA's
autocast leaves it), so CPU tensors in the same block are untouched.

How: torch.autocast takes a fixed list of device types, and `lazy` is not among them
(torch.autocast('lazy') raises "unsupported autocast device_type"), so this puts its own
kernels where autocast's sit in the dispatcher: on the AutocastPrivateUse1 key, which core
PyTorch leaves empty and no tensor of ratex carries. The block adds the key to the thread's
dispatch keys, so every op passes it, above autograd: a cast is an op autograd records, and
the gradient of a bfloat16 matmul is computed in bfloat16, as under CUDA autocast.

`torch.amp.GradScaler("lazy")` scales float16 losses on the lazy device. Its two ops (check
and unscale the gradients, update the scale) are traced as the elementwise ops they are, so
they join the step's program; the `.item()` in its step syncs once a step, as on CUDA.
"""
import functools
import threading

import torch

from .core.tensor import LazyTensor
from .core.tracing import registry
from .core.tracing.registry import DECOMPOSITION, register

aten = torch.ops.aten

# The op lists of PyTorch's CUDA autocast (aten/src/ATen/autocast_mode.h): 'name' or
# 'name.overload'; a bare name means every overload.
LOWER = (
    "_convolution.deprecated", "_convolution.default", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution.default", "prelu.default", "addmm.default",
    "addmv.default", "addr.default", "matmul.default", "einsum.default", "mm.default", "mv.default",
    "linalg_vecdot.default", "linear.default", "addbmm.default", "baddbmm.default", "bmm.default",
    "chain_matmul.default", "linalg_multi_dot.default", "_thnn_fused_lstm_cell.default",
    "_thnn_fused_gru_cell.default", "lstm_cell.default", "gru_cell.default", "rnn_tanh_cell.default",
    "rnn_relu_cell.default", "_scaled_dot_product_flash_attention.default", "scaled_dot_product_attention.default",
)
FP32 = (
    "acos.default", "asin.default", "cosh.default", "erfinv.default", "exp.default", "expm1.default", "log.default",
    "log10.default", "log2.default", "log1p.default", "reciprocal.default", "rsqrt.default", "sinh.default",
    "tan.default", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus.default", "layer_norm.default",
    "native_layer_norm.default", "group_norm.default", "frobenius_norm.dim", "nuclear_norm.default",
    "nuclear_norm.dim", "cosine_similarity.default", "poisson_nll_loss.default", "cosine_embedding_loss.default",
    "nll_loss.default", "nll_loss2d.default", "hinge_embedding_loss.default", "kl_div.default", "l1_loss.default",
    "smooth_l1_loss.default", "huber_loss.default", "mse_loss.default", "margin_ranking_loss.default",
    "multilabel_margin_loss.default", "soft_margin_loss.default", "triplet_margin_loss.default",
    "multi_margin_loss.default", "binary_cross_entropy_with_logits.default", "dist.default", "pdist.default",
    "cdist.default", "renorm.default", "logsumexp.default", "upsample_nearest1d.default",
    "_upsample_nearest_exact1d.default", "upsample_nearest2d.default", "_upsample_nearest_exact2d.default",
    "upsample_nearest3d.default", "_upsample_nearest_exact3d.default", "upsample_linear1d.default",
    "upsample_bilinear2d.default", "_upsample_bilinear2d_aa.default", "upsample_trilinear3d.default",
    "upsample_bicubic2d.default", "_upsample_bicubic2d_aa.default",
)
SET_DTYPE = (
    "prod.default", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod.default", "cumsum.default",
    "linalg_vector_norm.default", "linalg_matrix_norm.default", "linalg_matrix_norm.str_ord", "sum.default",
    "sum.dim_IntList",
)
# norm without a dtype argument: run as its overload that takes one, with float32.
APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
PROMOTE = (
    "addcdiv.default", "addcmul.default", "atan2.default", "bilinear.default", "cross.default", "dot.default",
    "vdot.default", "grid_sampler.default", "index_put.default", "tensordot.default", "scatter_add.default",
)
# Unsafe in low precision: CUDA's autocast refuses it, with this advice.
BANNED = {"binary_cross_entropy.default": (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast: a sigmoid before "
    "them loses precision in low precision. Use torch.nn.functional.binary_cross_entropy_with_logits or "
    "torch.nn.BCEWithLogitsLoss, which are safe to autocast"
)}

_KEY = torch._C.DispatchKey.AutocastPrivateUse1
_KEY_NAME = "AutocastPrivateUse1"
_CASTABLE = (torch.float16, torch.bfloat16, torch.float32)
_state = threading.local()  # .dtype: the low-precision dtype of the innermost enabled block; None outside
_libs = []  # the torch.library registrations, kept alive


class autocast:
    """Context manager and decorator: inside it, ops on lazy tensors run in `dtype` (bfloat16 or
    float16) or float32 by CUDA autocast's op lists (see the module doc); `enabled=False` turns
    an outer block off."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16, enabled: bool = True):
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"ratex.amp.autocast(dtype={dtype}): use torch.bfloat16 or torch.float16")
        if not isinstance(enabled, bool):
            raise ValueError(f"ratex.amp.autocast(enabled={enabled!r}): use True or False")
        self.dtype, self.enabled = dtype, enabled
        self._saved = []

    def __enter__(self):
        _register()
        self._saved.append((getattr(_state, "dtype", None), torch._C._dispatch_tls_is_dispatch_key_included(_KEY),
                            torch._C._dispatch_tls_is_dispatch_key_excluded(_KEY)))
        _state.dtype = self.dtype if self.enabled else None
        torch._C._dispatch_tls_set_dispatch_key_included(_KEY, self.enabled)
        torch._C._dispatch_tls_set_dispatch_key_excluded(_KEY, not self.enabled)
        return self

    def __exit__(self, *exc):
        dtype, included, excluded = self._saved.pop()
        _state.dtype = dtype
        torch._C._dispatch_tls_set_dispatch_key_included(_KEY, included)
        torch._C._dispatch_tls_set_dispatch_key_excluded(_KEY, excluded)
        return False

    def __call__(self, fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with autocast(self.dtype, self.enabled):
                return fn(*args, **kwargs)

        return run


def is_enabled() -> bool:
    """Return whether ops on lazy tensors are autocast here (inside an enabled `autocast`)."""
    return getattr(_state, "dtype", None) is not None


def get_dtype():
    """Return the low-precision dtype of the enclosing enabled `autocast`, or None."""
    return getattr(_state, "dtype", None)


# ---- the kernels ---------------------------------------------------------------------------
def _eligible(x) -> bool:
    return isinstance(x, LazyTensor) and x.dtype in _CASTABLE


def _cast(x, dtype):
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if _eligible(x) and x.dtype != dtype else x
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(y, dtype) for y in x)
    return x


def _tensors(args):
    for x in args:
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            yield from _tensors(x)


def _below(op, args, kwargs):
    """Run `op` from the keys below autocast's (its kernels must not run again on the casts)."""
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_KEY)):
        return op(*args, **kwargs)


def _lower(op):
    def kernel(*args, **kwargs):
        dtype = getattr(_state, "dtype", None)
        if dtype is not None and any(_eligible(t) for t in _tensors(args)):
            args, kwargs = _cast(args, dtype), {k: _cast(v, dtype) for k, v in kwargs.items()}
        return _below(op, args, kwargs)

    return kernel


def _fp32(op):
    def kernel(*args, **kwargs):
        if getattr(_state, "dtype", None) is not None and any(_eligible(t) for t in _tensors(args)):
            args, kwargs = _cast(args, torch.float32), {k: _cast(v, torch.float32) for k, v in kwargs.items()}
        return _below(op, args, kwargs)

    return kernel


def _set_dtype(op):
    """float32 as the op's dtype argument where the call gives none and its first input is eligible."""
    position = [a.name for a in op._schema.arguments].index("dtype")
    keyword = op._schema.arguments[position].kwarg_only

    def kernel(*args, **kwargs):
        if getattr(_state, "dtype", None) is not None and args and _eligible(args[0]):
            if keyword or position >= len(args):
                if kwargs.get("dtype") is None:
                    kwargs = dict(kwargs, dtype=torch.float32)
            elif args[position] is None:
                args = args[:position] + (torch.float32,) + args[position + 1:]
        return _below(op, args, kwargs)

    return kernel


def _append_dtype(op, with_dtype):
    def kernel(*args, **kwargs):
        if getattr(_state, "dtype", None) is not None and args and _eligible(args[0]):
            return _below(with_dtype, args, dict(kwargs, dtype=torch.float32))
        return _below(op, args, kwargs)

    return kernel


def _promote(op):
    def kernel(*args, **kwargs):
        if getattr(_state, "dtype", None) is not None:
            floats = [t.dtype for t in _tensors(list(args) + list(kwargs.values())) if _eligible(t)]
            if floats:
                widest = functools.reduce(torch.promote_types, floats)
                args, kwargs = _cast(args, widest), {k: _cast(v, widest) for k, v in kwargs.items()}
        return _below(op, args, kwargs)

    return kernel


def _banned(op, message):
    def kernel(*args, **kwargs):
        if getattr(_state, "dtype", None) is not None and any(_eligible(t) for t in _tensors(args)):
            raise RuntimeError(f"ratex.amp.autocast: {message}")
        return _below(op, args, kwargs)

    return kernel


def overload(name: str):
    """Return the aten OpOverload named 'op.overload' (raises naming it where torch lacks it)."""
    op, _, over = name.partition(".")
    try:
        return getattr(getattr(aten, op), over or "default")
    except AttributeError:
        raise RuntimeError(f"ratex.amp: torch {torch.__version__} has no aten.{name}; the autocast op lists "
                           "(ratex/amp.py) follow the torch that ratex pins") from None


def kernels() -> dict:
    """Return {'op.overload': kernel} for every op the autocast policies cover."""
    table = {}
    for names, make in ((LOWER, _lower), (FP32, _fp32), (SET_DTYPE, _set_dtype), (PROMOTE, _promote)):
        for name in names:
            table[name] = make(overload(name))
    for name, with_dtype in APPEND_DTYPE.items():
        table[name] = _append_dtype(overload(name), overload(with_dtype))
    for name, message in BANNED.items():
        table[name] = _banned(overload(name), message)
    return table


def _register():
    """Put the kernels on the autocast key, once; every other op falls through it."""
    if _libs:
        return
    try:
        fallback = torch.library.Library("_", "IMPL")
        fallback.fallback(torch.library.fallthrough_kernel, _KEY_NAME)
        lib = torch.library.Library("aten", "IMPL")
        for name, kernel in kernels().items():
            lib.impl(name.replace(".default", ""), kernel, _KEY_NAME)
    except RuntimeError as err:
        raise RuntimeError(f"ratex.amp.autocast puts its kernels on the {_KEY_NAME} dispatch key, but another "
                           f"library registered kernels there ({err}); a PrivateUse1 backend's autocast and "
                           "ratex's cannot be loaded together") from err
    _libs.extend((fallback, lib))


# ---- GradScaler's ops, as the elementwise ops they are -------------------------------------
def _call(op, *args, **kwargs):
    return registry.dispatch(op, args, kwargs)


@register(aten._amp_foreach_non_finite_check_and_unscale_.default, tier=DECOMPOSITION)
def unscale(grads, found_inf, inv_scale):
    """Multiply each gradient by `inv_scale` in place and set `found_inf` to 1 where one held an
    inf or NaN before, as PyTorch's kernel does; returns None."""
    if not all(isinstance(t, LazyTensor) for t in (*grads, found_inf, inv_scale)):
        return NotImplemented
    bad = None
    for g in grads:
        b = _call(aten.any.default, _call(aten.logical_not.default, _call(aten.isfinite.default, g)))
        bad = b if bad is None else _call(aten.logical_or.default, bad, b)
        _call(aten.mul_.Tensor, g, inv_scale)
    if bad is not None:
        flag = _call(aten._to_copy.default, bad, dtype=found_inf.dtype)
        _call(aten.copy_.default, found_inf, _call(aten.maximum.default, found_inf, flag))
    return None


@register(aten._amp_update_scale_.default, tier=DECOMPOSITION)
def update_scale(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    """Back the scale off after a step with infs, grow it after `growth_interval` steps without
    (never to inf), in place, as PyTorch's kernel does; returns `scale`."""
    if not all(isinstance(t, LazyTensor) for t in (scale, growth_tracker, found_inf)):
        return NotImplemented
    inf = _call(aten.ne.Scalar, found_inf, 0)
    successful = _call(aten.add.Tensor, growth_tracker, 1)
    grow = _call(aten.logical_and.default, _call(aten.logical_not.default, inf),
                 _call(aten.eq.Scalar, successful, growth_interval))
    grown = _call(aten.mul.Tensor, scale, growth_factor)
    kept = _call(aten.where.self, _call(aten.logical_and.default, grow, _call(aten.isfinite.default, grown)),
                 grown, scale)
    new_scale = _call(aten.where.self, inf, _call(aten.mul.Tensor, scale, backoff_factor), kept)
    new_tracker = _call(aten.where.self, _call(aten.logical_or.default, inf, grow),
                        _call(aten.zeros_like.default, successful), successful)
    _call(aten.copy_.default, scale, new_scale)
    _call(aten.copy_.default, growth_tracker, new_tracker)
    return scale


__all__ = ["autocast", "is_enabled", "get_dtype", "kernels", "LOWER", "FP32", "SET_DTYPE", "PROMOTE"]
