"""Random ops on the lazy device, recorded like any other op, drawing from a seed that is a graph input.

Each random call draws a fresh int64 seed from torch's generator (the
default CPU one, or the `generator=` passed), so `torch.manual_seed` makes a
run repeat, and passes it as a 0-dim input; the program derives its bits from
(seed, element index) with `ratex::random_bits`, a counter-based hash
(tvm_lowering/counter_rng.py), so a cached program draws new numbers every
step without recompiling.

Each distribution below is plain ATen arithmetic on those bits. The same
functions run on CPU tensors (`reference(...)`), which is the CPU reference
implementation: the compiled program computes the same values from the same
seed. The numbers differ from torch's own CPU generator's (another
algorithm): only their distribution matches.

Precision: uniforms carry the mantissa of their dtype, at most 24 random
bits (float64 too); normals (Box-Muller) and exponentials are computed in
float32 and cast. randint scales 32 bits to the range, so ranges wider than
2**31 (e.g. `random_()` on int64) run eagerly on CPU instead. Checks that
need the data (multinomial's probabilities are non-negative and leave enough
non-zero categories) are not made: they would cost a sync per call.
"""
import math

import torch

from tvm_lowering.counter_rng import words
from ..tensor import LazyTensor, check_device, is_lazy
from .eager import run as eager
from .inplace import assign
from .record import functional
from .registry import HANDLER, register

aten = torch.ops.aten
_lib = torch.library.Library("ratex", "DEF")
_lib.define("random_bits(Tensor seed, int[] size) -> Tensor")


@torch.library.impl(_lib, "random_bits", "CPU")
def _random_bits_cpu(seed, size):
    n = math.prod(size)
    return words(torch.arange(n, dtype=torch.int64), seed.to(torch.int64)).reshape(size)


@torch.library.register_fake("ratex::random_bits")
def _random_bits_meta(seed, size):
    return torch.empty(size, dtype=torch.int64, device=seed.device)


# Dropout's keep mask as one op: the mask's arithmetic on random_bits (below, in
# `bernoulli`) traced as six ops, most of a dropout's tracing. It computes the same
# bits: not (uniform24(bits) < p).
_lib.define("dropout_keep(Tensor seed, int[] size, Tensor p) -> Tensor")


@torch.library.impl(_lib, "dropout_keep", "CPU")
def _dropout_keep_cpu(seed, size, p):
    return aten.logical_not.default(bernoulli(seed, size, torch.bool, p))


@torch.library.register_fake("ratex::dropout_keep")
def _dropout_keep_meta(seed, size, p):
    return torch.empty(size, dtype=torch.bool, device=seed.device)


def new_seed(generator=None) -> torch.Tensor:
    """Return a 0-dim int64 seed drawn from `generator` (default: torch's default CPU generator)."""
    return torch.randint(0, 2**62, (), dtype=torch.int64, generator=generator)


# ---- distributions: ATen arithmetic on random words (lazy or CPU tensors) ---------------
def _bits(seed, size):
    return torch.ops.ratex.random_bits.default(seed, list(size))


def _unit(words_, digits, open_=False):
    """float32 uniforms k / 2**digits from the low `digits` bits; open_: (k + 1/2) / 2**digits, in (0, 1)."""
    k = aten._to_copy.default(aten.bitwise_and.Scalar(words_, (1 << digits) - 1), dtype=torch.float32)
    if open_:
        k = aten.add.Tensor(k, 0.5)  # exact: open_ uses at most 23 bits
    return aten.mul.Tensor(k, 2.0**-digits)


def _significand_bits(dtype):
    return 1 - int(math.log2(torch.finfo(dtype).eps))  # eps = 2**(1 - bits): 24 for float32


def _digits(dtype):
    """Random bits a uniform in `dtype` gets: as many as its significand holds, at most 24."""
    return min(24, _significand_bits(dtype))


def _compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _cast(x, dtype):
    return x if x.dtype == dtype else aten._to_copy.default(x, dtype=dtype)


def _affine(x, scale, shift, dtype):
    """x * scale + shift, in float64 for float64 results and float32 otherwise, cast to `dtype`."""
    x = _cast(x, _compute_dtype(dtype))
    if not (isinstance(scale, (int, float)) and scale == 1):
        x = aten.mul.Tensor(x, scale)
    if not (isinstance(shift, (int, float)) and shift == 0):
        x = aten.add.Tensor(x, shift)
    return _cast(x, dtype)


def uniform(seed, size, dtype, low=0.0, high=1.0):
    """Uniform on [low, high) with the random bits `dtype` can hold."""
    return _affine(_unit(_bits(seed, size), _digits(dtype)), high - low, low, dtype)


def _standard_normal(seed, size):
    """float32 N(0, 1) by Box-Muller: sqrt(-2 ln u1) cos(2 pi u2), u1 in (0, 1)."""
    w = _bits(seed, [2, *size])
    u1 = _unit(aten.select.int(w, 0, 0), 23, open_=True)
    u2 = _unit(aten.select.int(w, 0, 1), 24)
    radius = aten.sqrt.default(aten.mul.Tensor(aten.log.default(u1), -2.0))
    return aten.mul.Tensor(radius, aten.cos.default(aten.mul.Tensor(u2, 2 * math.pi)))


def normal(seed, size, dtype, mean=0.0, std=1.0):
    """N(mean, std**2); mean and std may be Python numbers or tensors broadcastable to `size`."""
    return _affine(_standard_normal(seed, size), std, mean, dtype)


def _standard_exponential(seed, size):
    return aten.neg.default(aten.log.default(_unit(_bits(seed, size), 23, open_=True)))


def exponential(seed, size, dtype, lambd=1.0):
    return _affine(_standard_exponential(seed, size), 1.0 / lambd, 0, dtype)


def log_normal(seed, size, dtype, mean=1.0, std=2.0):
    """exp(N(mean, std**2)): the exponential of a normal, in float64 for float64 results."""
    return _cast(aten.exp.default(normal(seed, size, _compute_dtype(dtype), mean, std)), dtype)


def cauchy(seed, size, dtype, median=0.0, sigma=1.0):
    """median + sigma * tan(pi v), v = u - 1/2 in (-1/2, 1/2): the inverse of Cauchy's CDF.

    tan(pi v) is computed as sin(pi v) / sin(pi (1/2 - |v|)), the cosine written as the
    sine of the distance to the pole: 1/2 - |v| is exact, so the tails keep their relative
    accuracy. (It also avoids TVM's tan, which vectorized under LLVM's reassociation
    returns wrong values.)
    """
    v = aten.sub.Tensor(_unit(_bits(seed, size), 23, open_=True), 0.5)  # exact: multiples of 2**-24
    to_pole = aten.rsub.Scalar(aten.abs.default(v), 0.5)
    sine = aten.sin.default(aten.mul.Tensor(v, math.pi))
    return _affine(aten.div.Tensor(sine, aten.sin.default(aten.mul.Tensor(to_pole, math.pi))), sigma, median, dtype)


def geometric(seed, size, dtype, p):
    """Trials up to the first success (1, 2, ...): ceil(ln u / ln(1 - p)) with u in (0, 1), the inverse CDF."""
    u = _unit(_bits(seed, size), 23, open_=True)
    return _cast(aten.ceil.default(aten.div.Tensor(aten.log.default(u), math.log1p(-p))), dtype)


def bernoulli(seed, size, dtype, p):
    """1 with probability p (a Python float or a tensor broadcastable to `size`), else 0, in `dtype`."""
    u = _unit(_bits(seed, size), 24)
    if isinstance(p, torch.Tensor):
        keep = aten.lt.Tensor(u, _cast(p, torch.float32))
    else:  # as a 0-dim input, so a p that changes (a schedule) doesn't recompile
        keep = aten.lt.Tensor(u, _scalar(float(p), torch.float32, like=u))
    return _cast(keep, dtype)


def dropout_keep(seed, size, p):
    """Dropout's keep mask (bool): where a uniform is >= p, i.e. not bernoulli(p).

    The lazy dropout and `ratex.jit.script`'s dropout both draw their mask here, so a
    scripted model draws the masks the unscripted one does from the same seeds. `p` is
    a 0-dim input, so a p that changes (a schedule) doesn't recompile.
    """
    return torch.ops.ratex.dropout_keep.default(seed, list(size), _scalar(float(p), torch.float32, like=seed))


def apply_dropout(x, keep, p):
    """x where `keep`, else 0, scaled by 1 / (1 - p). (tvm_lowering/torchscript.py records the same ops.)"""
    return aten.mul.Tensor(aten.mul.Tensor(x, keep), 1.0 / (1.0 - p))


MAX_INT_RANGE = 2**31


def randint(seed, size, dtype, low, high):
    """Integers in [low, high) (needs high - low <= 2**31): (32 random bits * range) >> 32, plus low."""
    scaled = aten.mul.Tensor(_bits(seed, size), high - low)
    out = aten.bitwise_right_shift.Tensor_Scalar(scaled, 32)
    if low:
        out = aten.add.Tensor(out, low)
    return _cast(out, dtype)


def randperm(seed, n, dtype):
    """A permutation of 0..n-1: the order that sorts n distinct random words."""
    return _cast(aten.sort.default(_bits(seed, [n]))[1], dtype)


def multinomial(seed, probs, num_samples, replacement):
    """Category indices (int64) drawn in proportion to the rows of `probs` (1-D or 2-D)."""
    batch, k = list(probs.shape[:-1]), probs.shape[-1]
    if not replacement:
        # The categories in order of exponential race times E / p: sampling without
        # replacement in proportion to p; a zero-probability category never finishes.
        race = aten.div.Tensor(_cast(_standard_exponential(seed, [*batch, k]), probs.dtype), probs)
        return aten.topk.default(aten.neg.default(race), num_samples, -1, True, True)[1]
    # Inverse CDF: the first category whose cumulative sum exceeds u * total, which has
    # p > 0. In float64, u (24 bits, < 1) times total is below total, so one exists.
    # The comparison is arithmetic (relu(sign(.)) is 1 or 0), not a bool tensor, and
    # argmax finds the first, not a count of the sums below: TVM's CPU reduction
    # schedule mis-vectorizes bool buffers and its CUDA GEMV rule crashes on that count.
    cdf = aten.cumsum.default(_cast(probs, torch.float64), -1)
    total = aten.slice.Tensor(cdf, -1, k - 1, k)
    target = aten.mul.Tensor(_cast(_unit(_bits(seed, [*batch, num_samples]), 24), torch.float64), total)
    gap = aten.sub.Tensor(aten.unsqueeze.default(cdf, -2), aten.unsqueeze.default(target, -1))
    return aten.argmax.default(aten.relu.default(aten.sign.default(gap)), -1)


def _scalar(value, dtype, like):
    cpu = torch.tensor(value, dtype=dtype)
    return LazyTensor.from_cpu(cpu, adopt=True) if is_lazy(like) else cpu


def reference(fn, seed, *args, **kwargs):
    """Run distribution `fn` (e.g. `normal`) on CPU from an int seed: what the lazy device computes."""
    return fn(torch.tensor(seed, dtype=torch.int64), *args, **kwargs)


# ---- dispatch: which ATen random ops record the arithmetic above ---------------------------
def _bind(func, args, kwargs) -> dict:
    """The call's arguments by schema name, defaults filled in."""
    bound = {a.name: a.default_value for a in func._schema.arguments if a.has_default_value()}
    bound.update(zip((a.name for a in func._schema.arguments), args))
    bound.update(kwargs)
    return bound


def _seed(a):
    return LazyTensor.from_cpu(new_seed(a.get("generator")), adopt=True)


def _torch_checks(inplace_op, a, *names):
    """Raise PyTorch's own error for bad arguments by running the op on an empty CPU tensor (draws nothing)."""
    inplace_op(torch.empty(0, dtype=a["self"].dtype), *[a[n] for n in names])


def _filler(dist, inplace_op, *names):
    """The handler of an in-place random fill and its functional form: `dist` drawn over
    self's shape and dtype with the arguments `names`, after PyTorch's own checks of them."""
    def draw(a):
        x = a["self"]
        _torch_checks(inplace_op, a, *names)
        return dist(_seed(a), x.shape, x.dtype, *[a[n] for n in names])

    return draw


_uniform = _filler(uniform, aten.uniform_.default, "from", "to")
_normal_ = _filler(normal, aten.normal_.default, "mean", "std")
_exponential = _filler(exponential, aten.exponential_.default, "lambd")
_log_normal = _filler(log_normal, aten.log_normal_.default, "mean", "std")
_cauchy = _filler(cauchy, aten.cauchy_.default, "median", "sigma")
_geometric_fill = _filler(geometric, aten.geometric_.default, "p")


def _normal_tensors(a):
    mean, std = a["mean"], a["std"]
    like = mean if isinstance(mean, torch.Tensor) else std
    if isinstance(std, float) and std < 0:
        raise RuntimeError(f"normal expects std >= 0.0, but found std {std}")
    size = torch.broadcast_shapes(*[t.shape for t in (mean, std) if isinstance(t, torch.Tensor)])
    return normal(_seed(a), size, like.dtype, mean, std)


def _geometric(a):
    if a["self"].dtype == torch.bool:
        return NotImplemented  # PyTorch's error
    return _geometric_fill(a)


def _bernoulli(a):
    x, p = a["self"], a.get("p", a["self"])  # bernoulli(x): x holds the probabilities
    if isinstance(p, float):
        _torch_checks(aten.bernoulli_.float, a, "p")
    elif not p.dtype.is_floating_point:
        return NotImplemented  # PyTorch's error
    return bernoulli(_seed(a), x.shape, x.dtype, p)


def _random_range(a):
    """[low, high) of random_/random in its three forms, as PyTorch defines them."""
    dtype = a["self"].dtype
    low, high = a.get("from", 0), a.get("to")
    if high is None:  # every integer the dtype holds exactly
        if dtype == torch.bool:
            high = 2
        elif dtype.is_floating_point:
            high = 2 ** _significand_bits(dtype) + 1
        else:
            high = torch.iinfo(dtype).max + 1
    return low, high


def _random(a):
    low, high = _random_range(a)
    if high - low > MAX_INT_RANGE:
        return NotImplemented
    names = [n for n in ("from", "to") if n in a]
    _torch_checks(getattr(aten.random_, "from" if "from" in a else "to" if "to" in a else "default"), a, *names)
    x = a["self"]
    return randint(_seed(a), x.shape, x.dtype, low, high)


def _like(a, fn, *extra):
    x = a["self"]
    if a.get("layout") not in (None, torch.strided):
        return NotImplemented  # a sparse result: PyTorch's own
    return fn(_seed(a), x.shape, a.get("dtype") or x.dtype, *extra)


def _elsewhere(func, args, kwargs):
    """A `*_like` result asked for on another device (device="cpu"): made there by PyTorch.

    The op reads only its input's metadata, so an uninitialized stand-in with the
    input's shape, strides and dtype replaces it: no copy of the input's data.
    """
    x = args[0]
    stand_in = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype)
    return func(stand_in, *args[1:], **kwargs)


def _randint_like(a):
    low, high = a.get("low", 0), a["high"]
    if isinstance(high, torch.Tensor) or not 0 < high - low <= MAX_INT_RANGE:
        return NotImplemented  # a tensor bound, or PyTorch's error for an empty range
    return _like(a, randint, low, high)


def _randperm_out(a):
    n, out = a["n"], a["out"]
    if n < 0 or tuple(out.shape) != (n,) or not is_lazy(out):
        return NotImplemented  # PyTorch's error, or an `out` to resize
    return randperm(_seed(a), n, out.dtype)


def _multinomial(a):
    probs, n, replacement = a["self"], a["num_samples"], a["replacement"]
    if not probs.dtype.is_floating_point:
        raise RuntimeError(f"multinomial only supports floating-point dtypes for input, got: {probs.dtype}")
    if probs.dim() not in (1, 2):
        raise RuntimeError(f"prob_dist must be 1 or 2 dim, got a tensor of shape {tuple(probs.shape)}")
    if probs.shape[-1] == 0:
        raise RuntimeError("multinomial: number of categories cannot be zero")
    if n <= 0:
        raise RuntimeError(f"cannot sample n_sample <= 0 samples, got num_samples={n}")
    if not replacement and n > probs.shape[-1]:
        raise RuntimeError(
            f"cannot sample n_sample > prob_dist.size(-1) samples without replacement "
            f"(num_samples={n}, categories={probs.shape[-1]})"
        )
    return multinomial(_seed(a), probs, n, replacement)


def _handled_by(builder, *funcs):
    """Route `funcs` to `builder(bound args)`; in-place and out= forms write its result back."""

    def handle(func, args, kwargs):
        a = _bind(func, args, kwargs)
        device = a.get("device")
        if device is not None and torch.device(device).type != "lazy":
            return _elsewhere(func, args, kwargs)
        if device is not None:
            check_device(device)
        target = a["out"] if "out" in a else a["self"] if func._schema.is_mutable else None
        out = builder(a)  # with no elements, every op's output is device data at once: nothing runs
        if out is NotImplemented:
            return eager(func, args, kwargs)
        if target is None:
            return out
        assign(target, out)
        return target

    register(*funcs, tier=HANDLER)(handle)


def _floats_only(builder):
    def build(a):
        dtype = a.get("dtype") or a["self"].dtype  # the _like forms may ask for another dtype
        return builder(a) if dtype.is_floating_point else NotImplemented  # PyTorch's error

    return build


_handled_by(_floats_only(_uniform), aten.uniform_.default, aten.uniform.default)
_handled_by(_floats_only(_normal_), aten.normal_.default, aten.normal_functional.default)
_handled_by(_normal_tensors, aten.normal.Tensor_Tensor, aten.normal.Tensor_float, aten.normal.float_Tensor)
_handled_by(_floats_only(_exponential), aten.exponential_.default, aten.exponential.default)
_handled_by(_floats_only(_log_normal), aten.log_normal_.default, aten.log_normal.default)
_handled_by(_floats_only(_cauchy), aten.cauchy_.default, aten.cauchy.default)
_handled_by(_geometric, aten.geometric_.default, aten.geometric.default)
_handled_by(_bernoulli, aten.bernoulli.default, aten.bernoulli.p, aten.bernoulli.Tensor,
          aten.bernoulli_.float, aten.bernoulli_.Tensor)
_handled_by(_random, *[getattr(packet, ov) for packet in (aten.random_, aten.random) for ov in ("from", "to", "default")])
_handled_by(_floats_only(lambda a: _like(a, uniform)), aten.rand_like.default, aten.rand_like.generator)
_handled_by(_floats_only(lambda a: _like(a, normal)), aten.randn_like.default, aten.randn_like.generator)
_handled_by(_randint_like, aten.randint_like.default, aten.randint_like.low_dtype,
          aten.randint_like.generator, aten.randint_like.low_generator_dtype)
_handled_by(_randperm_out, aten.randperm.generator_out, aten.randperm.out)
_handled_by(_multinomial, aten.multinomial.default)


@register(aten.native_dropout.default, tier=HANDLER)
def _native_dropout(func, args, kwargs):
    """Training-mode dropout: keep where a uniform >= p, scaled by 1 / (1 - p); returns (out, mask)."""
    x, p = args[0], args[1]
    train = args[2] if len(args) > 2 else kwargs.get("train")
    if not train or p == 0 or p >= 1 or not x.dtype.is_floating_point:
        return functional(func, args, kwargs)
    keep = dropout_keep(_seed({}), x.shape, p)
    return apply_dropout(x, keep, p), keep



@register(aten.rrelu_with_noise.default, aten.rrelu_with_noise_.default, aten.rrelu_with_noise_functional.default,
          tier=HANDLER)
def _rrelu_with_noise(func, args, kwargs):
    """Randomized leaky ReLU; returns its output ((output, noise) for the functional form).

    Training: where x <= 0 the slope is r ~ U(lower, upper), and `noise` becomes r
    there and 1 elsewhere (its backward is grad * noise), so the output is x * noise.
    Eval: leaky_relu with the mean slope (lower + upper) / 2; noise is left as it is.
    """
    a = _bind(func, args, kwargs)
    x, noise, lower, upper = a["self"], a["noise"], a["lower"], a["upper"]
    if not x.dtype.is_floating_point or tuple(noise.shape) != tuple(x.shape):
        return eager(func, args, kwargs)  # PyTorch's error, or a noise tensor to resize
    if lower > upper:  # PyTorch checks this on CPU only when there are elements
        raise RuntimeError(f"Lower bound should be less than or equal to the upper bound, got lower={lower} > upper={upper}")
    if a["training"]:
        slope = uniform(_seed(a), x.shape, x.dtype, lower, upper)
        ones = functional(aten.ones_like.default, (slope,), {})
        noise_value = aten.where.self(aten.le.Scalar(x, 0), slope, ones)
        out = aten.mul.Tensor(x, noise_value)
    else:
        noise_value = None
        out = aten.leaky_relu.default(x, (lower + upper) / 2)
    if func is aten.rrelu_with_noise_functional.default:
        return out, aten.clone.default(noise) if noise_value is None else noise_value
    if noise_value is not None:
        assign(noise, noise_value)
    if func is aten.rrelu_with_noise_.default:
        assign(x, out)
        return x
    return out

