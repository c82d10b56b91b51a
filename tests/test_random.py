"""Random ops on the lazy device.

They are recorded (no eager fallback) and draw from a seed that is a graph input: the
distributions match PyTorch's (moments of 1e5 samples, support, dtype, shape), a cached
program draws fresh numbers every step with one compile, torch.manual_seed makes a run
repeat, and the compiled program computes what the CPU reference implementation
(ratex.core.tracing.random on CPU tensors) computes. The numbers themselves differ from
PyTorch's CPU generator's: another algorithm.
"""
import pytest
import torch
import torch.nn.functional as F

import ratex.lazy_tensor_core.core.lazy_model as lm
import tvm_lowering
from ratex.core import graph, sync
from ratex.core.tracing import random
from ratex.lazy_tensor_core.debug import metrics

LAZY = torch.device("lazy", 0)
N = 100_000
PROBS = [0.2, 0.0, 0.5, 0.3]


def _filled(d, value, dtype=torch.float32):
    return torch.full((N,), value, dtype=dtype, device=d)


# name -> (draw on device d, support check on the values as float64)
CASES = {
    "rand": (lambda d: torch.rand(N, device=d), lambda v: (v >= 0) & (v < 1)),
    "rand_bf16": (lambda d: torch.rand(N, device=d, dtype=torch.bfloat16), lambda v: (v >= 0) & (v < 1)),
    "rand_like_f16": (lambda d: torch.rand_like(_filled(d, 0.0), dtype=torch.float16), lambda v: (v >= 0) & (v < 1)),
    "randn": (lambda d: torch.randn(N, device=d), None),
    "randn_like_f64": (lambda d: torch.randn_like(_filled(d, 0.0, torch.float64)), None),
    "normal_": (lambda d: _filled(d, 0.0).normal_(2.0, 3.0), None),
    "normal_tensors": (lambda d: torch.normal(_filled(d, -1.0), _filled(d, 0.5)), None),
    "normal_float_std": (lambda d: torch.normal(_filled(d, 4.0), 2.0), None),
    "uniform_": (lambda d: _filled(d, 0.0).uniform_(-2.0, 3.0), lambda v: (v >= -2) & (v < 3)),
    "exponential_": (lambda d: _filled(d, 0.0).exponential_(2.0), lambda v: v >= 0),
    "bernoulli_float": (lambda d: _filled(d, 0.0).bernoulli_(0.3), lambda v: (v == 0) | (v == 1)),
    "bernoulli_tensor": (lambda d: torch.bernoulli(_filled(d, 0.7)), lambda v: (v == 0) | (v == 1)),
    "bernoulli_int": (lambda d: _filled(d, 0, torch.int32).bernoulli_(0.6), lambda v: (v == 0) | (v == 1)),
    "randint": (lambda d: torch.randint(-5, 17, (N,), device=d), lambda v: (v >= -5) & (v < 17) & (v == v.round())),
    "randint_like": (lambda d: torch.randint_like(_filled(d, 0.0), 3, 9), lambda v: (v >= 3) & (v < 9)),
    "random_float": (lambda d: _filled(d, 0.0).random_(10), lambda v: (v >= 0) & (v < 10) & (v == v.round())),
    "random_float_default": (lambda d: _filled(d, 0.0).random_(), lambda v: (v >= 0) & (v <= 2**24) & (v == v.round())),
    "random_int32": (lambda d: _filled(d, 0, torch.int32).random_(), lambda v: (v >= 0) & (v < 2**31)),
    "multinomial": (lambda d: torch.multinomial(torch.tensor(PROBS).to(d), N, replacement=True),
                    lambda v: (v >= 0) & (v < 4) & (v != 1)),
}


def draw_all(draws):
    """{name: draw(device)} drawn on the lazy device in one step and on CPU PyTorch:
    (lazy results, CPU results, (eager-fallback counters, programs compiled))."""
    torch.manual_seed(0)
    sync.reset_cache()
    metrics.reset()
    lazy = {name: draw(LAZY) for name, draw in draws.items()}
    lm.mark_step()
    fallbacks = [c for c in metrics.counter_names() if c.startswith("aten::")]
    compiles = metrics.counter_value("UncachedCompile")
    return {name: t.cpu() for name, t in lazy.items()}, {name: draw("cpu") for name, draw in draws.items()}, (
        fallbacks, compiles)


@pytest.fixture(scope="module")
def drawn():
    """Every case drawn on the lazy device in one step, and on CPU PyTorch."""
    return draw_all({name: draw for name, (draw, _) in CASES.items()})


def test_random_ops_record_into_one_program(drawn):
    fallbacks, compiles = drawn[2]
    assert fallbacks == []
    assert compiles == 1


@pytest.mark.parametrize("name", list(CASES))
def test_distribution_matches_pytorch(drawn, name):
    assert_same_distribution(drawn[0][name], drawn[1][name], CASES[name][1])


def assert_same_distribution(got, want, support, comparable=None):
    """Same dtype and shape, every value in `support` (a predicate, or None), and the same mean
    and standard deviation within 5 standard errors (after `comparable`, for heavy tails)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.double(), want.double()
    if support is not None:
        assert bool(support(w).all()), "the support check is wrong for PyTorch itself"
        assert bool(support(g).all()), f"values outside the support: {g[~support(g)][:5]}"
    if comparable is not None:
        g, w = comparable(g), comparable(w)
    tol = 0.03 * w.std().item() + 1e-3  # about 5 standard errors of either statistic at n = 1e5
    assert abs(g.mean().item() - w.mean().item()) < tol, (g.mean(), w.mean())
    assert abs(g.std().item() - w.std().item()) < tol, (g.std(), w.std())


def test_multinomial_frequencies(drawn):
    counts = torch.bincount(drawn[0]["multinomial"], minlength=4).double() / N
    torch.testing.assert_close(counts, torch.tensor(PROBS, dtype=torch.float64), atol=0.01, rtol=0)


def _step(d):
    """One 'training step' worth of random ops; returns their values."""
    x = torch.zeros(64, 8, device=d)
    probs = torch.tensor([[0.0, 1.0, 2.0, 0.0, 3.0], [1.0, 0.0, 0.0, 1.0, 1.0]]).to(d)
    outs = [
        torch.rand(64, device=d), torch.randn(3, 5, device=d), x.clone().bernoulli_(0.5),
        torch.randint(0, 1000, (64,), device=d), torch.randperm(50, device=d),
        torch.multinomial(probs, 3), torch.multinomial(probs, 8, replacement=True),
        F.dropout(torch.ones(64, device=d), 0.5),
    ]
    lm.mark_step()
    return [o.cpu() for o in outs]


def test_cached_program_draws_fresh_values_and_manual_seed_repeats(dev):
    sync.reset_cache()
    torch.manual_seed(1)
    first = _step(dev)
    second = _step(dev)
    assert metrics.counter_value("UncachedCompile") == 1
    assert not [c for c in metrics.counter_names() if c.startswith("aten::")]
    for a, b in zip(first, second):
        assert not torch.equal(a, b)
    torch.manual_seed(1)
    for a, b in zip(first, _step(dev)):
        assert torch.equal(a, b)
    assert metrics.counter_value("UncachedCompile") == 1


def test_randperm_is_a_permutation_and_multinomial_skips_zero_probabilities(dev):
    perm, without, with_ = (t for i, t in enumerate(_step(dev)) if i in (4, 5, 6))
    assert torch.equal(perm.sort().values, torch.arange(50))
    zero = torch.tensor([[1, 0, 0, 1, 0], [0, 1, 1, 0, 0]], dtype=torch.bool)
    for drawn_ in (without, with_):
        assert not zero.gather(1, drawn_).any()
    assert all(len(set(row.tolist())) == 3 for row in without)  # no category twice


def test_explicit_generator_is_honoured(dev):
    def draw():
        g = torch.Generator().manual_seed(7)
        return torch.rand(10, device=dev, generator=g).cpu()

    torch.manual_seed(3)
    a = draw()
    torch.manual_seed(4)
    assert torch.equal(a, draw())


SEED = 0x123456789ABC
EXACT = {  # integer arithmetic, comparisons and orderings of random keys: identical results
    "bits": lambda s: torch.ops.ratex.random_bits(s, [7, 33]),
    "unit_uniform": lambda s: random.uniform(s, [7, 33], torch.float32),
    "bf16_uniform": lambda s: random.uniform(s, [65], torch.bfloat16),
    "bernoulli": lambda s: random.bernoulli(s, [300], torch.float32, 0.25),
    "dropout_keep": lambda s: random.dropout_keep(s, [300], 0.25),
    "randint": lambda s: random.randint(s, [300], torch.int32, -7, 1000),
    "randperm": lambda s: random.randperm(s, 300, torch.int64),
    "multinomial": lambda s: random.multinomial(s, _probs(s), 50, True),
    "multinomial_without": lambda s: random.multinomial(s, _probs(s), 3, False),
}
CLOSE = {  # affine maps, log, cos: TVM contracts a*b+c to an FMA and has its own log/cos
    "uniform": lambda s: random.uniform(s, [300], torch.float32, -2.0, 3.0),
    "normal": lambda s: random.normal(s, [300], torch.float32, 1.0, 2.0),
    "exponential": lambda s: random.exponential(s, [300], torch.float32, 3.0),
}


def _probs(s):
    return torch.tensor([[0.1, 0.0, 0.6, 0.3], [0.5, 0.2, 0.0, 0.3]]).to(s.device)


@pytest.fixture(scope="module")
def compiled_and_reference():
    """Every function above on a lazy seed (one program) and on the same seed on CPU."""
    funcs = {**EXACT, **CLOSE}
    metrics.reset()
    lazy = {name: fn(torch.tensor(SEED).to(LAZY)) for name, fn in funcs.items()}
    lm.mark_step()
    fallbacks = [c for c in metrics.counter_names() if c.startswith("aten::")]
    return {n: t.cpu() for n, t in lazy.items()}, {n: fn(torch.tensor(SEED)) for n, fn in funcs.items()}, fallbacks


@pytest.mark.parametrize("name", list(EXACT) + list(CLOSE))
def test_compiled_values_equal_cpu_reference(compiled_and_reference, name):
    got, want, fallbacks = compiled_and_reference[0][name], compiled_and_reference[1][name], compiled_and_reference[2]
    assert fallbacks == []
    if name in EXACT:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


def test_bad_arguments_raise_pytorchs_errors(dev):
    x = torch.zeros(3, device=dev)
    with pytest.raises(RuntimeError, match="from=2 > to=1"):
        x.uniform_(2.0, 1.0)
    with pytest.raises(RuntimeError, match="std >= 0.0"):
        x.normal_(0.0, -1.0)
    with pytest.raises(RuntimeError, match=r"p to be in \[0, 1\]"):
        x.bernoulli_(1.5)
    with pytest.raises(RuntimeError, match="without replacement"):
        torch.multinomial(x + 1, 4)
    with pytest.raises(RuntimeError, match="floating-point"):
        torch.multinomial(torch.ones(3, dtype=torch.int64, device=dev), 1)


def test_ranges_wider_than_32_bits_fall_back_correctly(dev):
    torch.manual_seed(5)
    got = torch.zeros(1000, dtype=torch.int64, device=dev).random_().cpu()
    assert metrics.counter_value("aten::random_.default") == 1
    assert got.min() >= 0 and got.max() > 2**40  # PyTorch's range: [0, 2**63 - 1]


# ---- dropout ------------------------------------------------------------------------
def _dropout_step(dev, p=0.3):
    x = torch.ones(200, 50, device=dev).requires_grad_()
    y = F.dropout(x, p, training=True)
    y.sum().backward()
    lm.mark_step()
    return y.cpu(), x.grad.cpu()


def test_dropout_keep_rate_scaling_and_grad(dev):
    torch.manual_seed(0)
    y, grad = _dropout_step(dev)
    dropped = (y == 0).float().mean().item()
    assert abs(dropped - 0.3) < 0.02, dropped
    torch.testing.assert_close(y[y != 0], torch.full_like(y[y != 0], 1 / 0.7))
    torch.testing.assert_close(grad, y)  # d(sum(dropout(x)))/dx = mask * scale
    assert "ratex::dropout_keep.default" in metrics.counter_names()
    assert not [c for c in metrics.counter_names() if c.startswith("aten::")]


def test_eval_mode_dropout_is_identity(dev):
    x = torch.randn(4, 4)
    torch.testing.assert_close(F.dropout(x.to(dev), 0.5, training=False).cpu(), x)


def test_random_ops_build_for_cuda(dev):
    """The hash (int64 TIR) and multinomial's inverse-CDF reduction pass TVM's CUDA schedules."""
    probs = torch.tensor([[0.0, 1.0, 2.0], [1.0, 0.0, 1.0]]).to(dev)
    outs = [torch.rand(64, device=dev), torch.multinomial(probs, 4, replacement=True)]
    step = graph.cut([o._value() for o in outs])
    mod = tvm_lowering.import_graph(graph.to_fx(step), library=False)
    executable = tvm_lowering.build(mod, tvm_lowering.resolve_target("GPU", "sm_90"))
    assert "main" in executable.as_text()
    lm.mark_step()  # leave nothing pending for other tests
