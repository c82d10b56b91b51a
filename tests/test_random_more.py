"""More random ops on the lazy device: the *_like factories, log_normal, cauchy, geometric, rrelu.

Like tests/test_random.py: each op is recorded (no `aten::` fallback counter), its
distribution matches PyTorch's CPU one over 1e5 samples (moments after a map that
makes them comparable, support, dtype, shape), a cached program draws fresh numbers
every step, torch.manual_seed repeats a run, and the compiled program computes what
the CPU reference implementation (ratex.core.tracing.random on CPU tensors) computes.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex.core import sync
from ratex.core.tracing import random
from ratex.lazy_tensor_core.debug import metrics
from test_random import assert_same_distribution, draw_all

aten = torch.ops.aten
LAZY = torch.device("lazy", 0)
N = 100_000
PROBS = [0.1, 0.0, 0.6, 0.3]


def _filled(d, value, dtype=torch.float32):
    return torch.full((N,), value, dtype=dtype, device=d)


def _integers(lo, hi=math.inf):
    return lambda v: (v >= lo) & (v < hi) & (v == v.round())


def _in(lo, hi):
    return lambda v: (v >= lo) & (v < hi)


def _alternating(d):
    """-1, 2, -1, 2, ...: rrelu scales the negatives by a random slope and keeps the positives."""
    return torch.tensor([-1.0, 2.0]).repeat(N // 2).to(d)


def _first_draws(d, replacement):
    """multinomial(PROBS) once per row of N rows: the category drawn first."""
    return torch.multinomial(torch.tensor(PROBS).expand(N, 4).to(d), 2, replacement=replacement)[:, 0]


# name -> (draw on device d, support of the values as float64 or None,
#          a map making the moments comparable or None: heavy tails compared through their CDF)
CASES = {
    "rand_like": (lambda d: torch.rand_like(_filled(d, 5.0)), _in(0, 1), None),
    "randn_like_bf16": (lambda d: torch.randn_like(_filled(d, 5.0), dtype=torch.bfloat16), None, None),
    "randint_like_high": (lambda d: torch.randint_like(_filled(d, 0.0), 7, dtype=torch.int64), _integers(0, 7), None),
    "randint_like_generator": (lambda d: torch.randint_like(_filled(d, 0.0), -3, 4, generator=torch.Generator()),
                               _integers(-3, 4), None),
    "uniform": (lambda d: aten.uniform(_filled(d, 0.0), -1.0, 2.0), _in(-1, 2), None),
    "normal_float_tensor": (lambda d: torch.normal(2.0, _filled(d, 3.0)), None, None),
    "normal_f64": (lambda d: _filled(d, 0.0, torch.float64).normal_(-1.0, 0.25), None, None),
    "log_normal_": (lambda d: _filled(d, 0.0).log_normal_(0.5, 0.75), lambda v: v > 0, torch.log),
    "log_normal": (lambda d: aten.log_normal(_filled(d, 0.0, torch.float64)), lambda v: v > 0, torch.log),
    "cauchy_": (lambda d: _filled(d, 0.0).cauchy_(1.0, 2.0), None, lambda v: torch.atan((v - 1.0) / 2.0)),
    "cauchy": (lambda d: aten.cauchy(_filled(d, 0.0, torch.float16)), None, torch.atan),
    "geometric_": (lambda d: _filled(d, 0.0).geometric_(0.3), _integers(1), None),
    "geometric_int": (lambda d: aten.geometric(_filled(d, 0, torch.int32), 0.8), _integers(1), None),
    "bernoulli_probs": (lambda d: torch.bernoulli(torch.linspace(0, 1, N).to(d)), _integers(0, 2), None),
    "multinomial_first": (lambda d: _first_draws(d, False), lambda v: _integers(0, 4)(v) & (v != 1), None),
    "rrelu_train": (lambda d: F.rrelu(_alternating(d), 0.1, 0.3, training=True),
                    lambda v: (v == 2) | ((v > -0.3) & (v <= -0.1)), None),
}


@pytest.fixture(scope="module")
def drawn():
    """Every case drawn on the lazy device in one step, and on CPU PyTorch."""
    return draw_all({name: case[0] for name, case in CASES.items()})


def test_random_ops_record_into_one_program(drawn):
    fallbacks, compiles = drawn[2]
    assert fallbacks == []
    assert compiles == 1


@pytest.mark.parametrize("name", list(CASES))
def test_distribution_matches_pytorch(drawn, name):
    _, support, comparable = CASES[name]
    assert_same_distribution(drawn[0][name], drawn[1][name], support, comparable)


def test_first_draw_of_multinomial_without_replacement_follows_the_probabilities(drawn):
    counts = torch.bincount(drawn[0]["multinomial_first"], minlength=4).double() / N
    torch.testing.assert_close(counts, torch.tensor(PROBS, dtype=torch.float64), atol=0.01, rtol=0)


def test_rrelu_slopes_are_uniform_and_positives_pass_through(drawn):
    y = drawn[0]["rrelu_train"]
    assert torch.equal(y[1::2], torch.full((N // 2,), 2.0))
    slopes = -y[0::2].double()
    assert abs(slopes.mean().item() - 0.2) < 1e-3  # U(0.1, 0.3): mean 0.2, std 0.058
    assert abs(slopes.std().item() - 0.2 / math.sqrt(12)) < 1e-3


# ---- a cached program across steps ---------------------------------------------------------------
def _step(d):
    """One 'training step' of the ops above on small tensors; returns their values and rrelu's grad."""
    x = torch.zeros(64, device=d)
    probs = torch.tensor([[0.0, 1.0, 2.0, 0.0, 3.0], [1.0, 0.0, 0.0, 1.0, 1.0]]).to(d)
    act = torch.linspace(-2, 2, 64).to(d).requires_grad_()
    y = F.rrelu(act, 0.1, 0.5, training=True)
    y.sum().backward()
    outs = [
        torch.rand_like(x), torch.randn_like(x), torch.randint_like(x, 100), aten.uniform(x, -1.0, 1.0),
        torch.normal(x, x + 1), x.clone().log_normal_(), x.clone().cauchy_(), x.clone().geometric_(0.5),
        torch.bernoulli(x + 0.5), torch.multinomial(probs, 3), y, act.grad,
    ]
    lm.mark_step()
    return [o.detach().cpu() for o in outs]


def test_cached_program_draws_fresh_values_and_manual_seed_repeats(dev):
    sync.reset_cache()
    torch.manual_seed(1)
    first = _step(dev)
    compiles = metrics.counter_value("UncachedCompile")
    second = _step(dev)
    assert metrics.counter_value("UncachedCompile") == compiles  # the second step reuses the program
    assert not [c for c in metrics.counter_names() if c.startswith("aten::")]
    for i, (a, b) in enumerate(zip(first, second)):
        assert not torch.equal(a, b), i
    torch.manual_seed(1)
    for a, b in zip(first, _step(dev)):
        assert torch.equal(a, b)
    assert metrics.counter_value("UncachedCompile") == compiles


def test_rrelu_backward_is_the_drawn_slope(dev):
    torch.manual_seed(2)
    *_, y, grad = _step(dev)
    x = torch.linspace(-2, 2, 64)
    negative = x <= 0
    assert bool(((grad[negative] >= 0.1) & (grad[negative] < 0.5)).all())
    assert torch.equal(grad[~negative], torch.ones(int((~negative).sum())))
    torch.testing.assert_close(y, x * grad)  # the slope of the output is the gradient


def test_rrelu_with_noise_writes_its_noise(dev):
    torch.manual_seed(3)
    x = torch.tensor([-1.0, 0.0, 3.0, -2.0])
    noise = torch.full((4,), 7.0, device=dev)
    y = aten.rrelu_with_noise(x.to(dev), noise, 0.2, 0.4, True).cpu()
    noise = noise.cpu()
    assert noise[2] == 1 and ((noise[[0, 1, 3]] >= 0.2) & (noise[[0, 1, 3]] < 0.4)).all()  # x <= 0 draws
    torch.testing.assert_close(y, x * noise)
    inplace = x.to(dev)
    F.rrelu(inplace, 0.2, 0.4, training=True, inplace=True)
    inplace = inplace.cpu()
    assert torch.equal(inplace[2], x[2]) and ((inplace[[0, 3]] / x[[0, 3]] >= 0.2) & (inplace[[0, 3]] / x[[0, 3]] < 0.4)).all()
    assert not [c for c in metrics.counter_names() if c.startswith("aten::")]


def test_eval_rrelu_matches_cpu_forward_and_backward(dev):
    x = torch.tensor([-3.0, -0.5, 0.0, 0.25, 4.0])
    got_x = x.to(dev).requires_grad_()
    got = F.rrelu(got_x, 0.1, 0.3, training=False)
    got.backward(torch.arange(5.0).to(dev))
    want_x = x.clone().requires_grad_()
    want = F.rrelu(want_x, 0.1, 0.3, training=False)
    want.backward(torch.arange(5.0))
    torch.testing.assert_close(got.detach().cpu(), want.detach())
    torch.testing.assert_close(got_x.grad.cpu(), want_x.grad)
    assert not [c for c in metrics.counter_names() if c.startswith("aten::")]


def test_normal_with_tensor_mean_and_std_has_pytorchs_gradients(dev):
    """PyTorch defines zero gradients for normal's mean and std (not reparameterized): the same here."""
    def grads(d):
        mean = torch.zeros(3, 4, device=d, requires_grad=True)
        std = torch.ones(4, device=d, requires_grad=True)
        (torch.normal(mean, std) * torch.arange(12.0).view(3, 4).to(d)).sum().backward()
        return mean.grad.cpu(), std.grad.cpu()

    for got, want in zip(grads(dev), grads("cpu")):
        torch.testing.assert_close(got, want)
    assert not [c for c in metrics.counter_names() if c.startswith("aten::")]


def test_like_ops_honour_an_explicit_generator(dev):
    def draw():
        g = torch.Generator().manual_seed(7)
        x = torch.zeros(10, device=dev)
        outs = [torch.rand_like(x, generator=g), torch.randn_like(x, generator=g), torch.randint_like(x, 5, generator=g)]
        return [o.cpu() for o in outs]

    torch.manual_seed(3)
    first = draw()
    torch.manual_seed(4)
    assert all(torch.equal(a, b) for a, b in zip(first, draw()))
    assert not [c for c in metrics.counter_names() if c.startswith("aten::")]


# ---- corners --------------------------------------------------------------------------------------
def test_like_ops_on_another_device_read_no_input_data(dev):
    torch.manual_seed(4)
    pending = torch.ones(5, 3, device=dev).t() * 2  # not computed yet: reading it would need a step
    outs = [torch.rand_like(pending, device="cpu"), torch.randn_like(pending, device="cpu", dtype=torch.float64),
            torch.randint_like(pending, 2, 9, device="cpu")]
    assert [(o.device.type, o.dtype, o.shape, o.stride()) for o in outs] == [
        ("cpu", torch.float32, (3, 5), (1, 3)), ("cpu", torch.float64, (3, 5), (1, 3)),
        ("cpu", torch.float32, (3, 5), (1, 3))]  # strides preserved, as on CPU
    assert metrics.counter_value("UncachedCompile") in (None, 0)
    assert not [c for c in metrics.counter_names() if c.startswith("aten::")]
    lm.mark_step()


def test_draws_without_elements_need_no_program(dev):
    empty = torch.zeros(0, 5, 0, device=dev)
    outs = [torch.randn_like(empty), torch.randint_like(empty, 3), torch.bernoulli(empty), empty.cauchy_(),
            aten.geometric(empty, 0.5), torch.multinomial(torch.ones(0, 3, device=dev), 2)]
    assert [tuple(o.shape) for o in outs] == [(0, 5, 0)] * 5 + [(0, 2)]
    lm.mark_step()
    assert metrics.counter_value("UncachedCompile") in (None, 0)
    assert not [c for c in metrics.counter_names() if c.startswith("aten::")]
    with pytest.raises(RuntimeError, match="p to be in"):  # bad arguments still raise with nothing to draw
        empty.geometric_(1.5)


def test_bad_arguments_raise_pytorchs_errors(dev):
    x = torch.zeros(3, device=dev)
    with pytest.raises(RuntimeError, match=r"p to be in \(0, 1\)"):
        x.geometric_(0.0)
    with pytest.raises(RuntimeError, match="sigma > 0.0"):
        x.cauchy_(0.0, -1.0)
    with pytest.raises(RuntimeError, match="std > 0.0"):
        x.log_normal_(1.0, 0.0)
    with pytest.raises(RuntimeError, match="Lower bound should be less than or equal to the upper bound"):
        F.rrelu(x, 0.5, 0.1, training=True)
    with pytest.raises(RuntimeError, match="lower=0.5 > upper=0.1"):  # PyTorch's CPU kernel checks only with elements
        aten.rrelu_with_noise(x[:0], x[:0], 0.5, 0.1, True)
    with pytest.raises(RuntimeError, match="floating point"):
        torch.zeros(3, dtype=torch.int32, device=dev).cauchy_()
    with pytest.raises(RuntimeError, match="Bool"):  # PyTorch's own error, from CPU
        torch.zeros(3, dtype=torch.bool, device=dev).geometric_(0.5)


# ---- the compiled program computes the CPU reference's values ---------------------------------------
SEED = 0x2468ACE0
REFERENCE = {
    "log_normal": lambda s: random.log_normal(s, [300], torch.float32, 0.5, 0.5),
    "cauchy": lambda s: random.cauchy(s, [300], torch.float32, 1.0, 2.0),
    "geometric": lambda s: random.geometric(s, [300], torch.float32, 0.2),
}


def test_compiled_values_equal_cpu_reference(dev):
    lazy = {name: fn(torch.tensor(SEED).to(dev)) for name, fn in REFERENCE.items()}
    lm.mark_step()
    assert not [c for c in metrics.counter_names() if c.startswith("aten::")]
    for name, fn in REFERENCE.items():
        # TVM has its own log/tan/exp: close, and tan near its poles magnifies an ulp of its argument
        torch.testing.assert_close(lazy[name].cpu(), fn(torch.tensor(SEED)), rtol=1e-4, atol=1e-5, msg=name)
