"""Dtypes on the lazy device: each dtype's arithmetic, reductions and comparisons, PyTorch's
type promotion, bf16/fp16 compute rounded where PyTorch's CPU kernels round (checked in the
compiled Relax too), and a clipped foreach-Adam training loop with a scheduler that syncs only
at mark_step. All against CPU PyTorch."""
import copy
import re

import pytest
import torch
import torch.nn.functional as F

import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex import config
from ratex.lazy_tensor_core.debug import metrics
from conftest import ON_CPU
from rule_check import train_side_by_side

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int32, torch.int64]


def _fallbacks():
    return [c for c in metrics.counter_names() if c.startswith("aten::")]


def _tol(dtype):
    """PyTorch's CPU and TVM may round low-precision intermediates differently (fusion keeps float32)."""
    return {torch.float16: dict(rtol=1e-2, atol=1e-2), torch.bfloat16: dict(rtol=2e-2, atol=5e-2)}.get(dtype, {})


def _run(dev, cases, *inputs):
    """Apply every case to lazy copies of `inputs` in one step and to `inputs` on CPU; compare."""
    lazy = [x.to(dev) for x in inputs]
    got = {name: fn(*lazy) for name, fn in cases.items()}
    lm.mark_step()
    for name, fn in cases.items():
        want, out = fn(*inputs), got[name].cpu()
        assert out.dtype == want.dtype and out.shape == want.shape, (name, out.dtype, want.dtype)
        torch.testing.assert_close(out, want, **_tol(want.dtype), msg=lambda m: f"{name}: {m}")
    assert _fallbacks() == []


def _samples(dtype, g):
    if dtype == torch.bool:
        return torch.rand(6, 5, generator=g) > 0.5, torch.rand(6, 5, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(6, 5, generator=g).to(dtype), torch.randn(6, 5, generator=g).to(dtype)
    return torch.randint(-50, 50, (6, 5), generator=g, dtype=dtype), torch.randint(1, 9, (6, 5), generator=g, dtype=dtype)


COMMON = {
    "lt": lambda x, y: x < y, "ge": lambda x, y: x >= y, "eq": lambda x, y: x == y, "ne": lambda x, y: x != y,
    "where": lambda x, y: torch.where(x > y, x, y), "sum": lambda x, y: x.sum(), "max": lambda x, y: x.amax(1),
    "cat": lambda x, y: torch.cat([x, y]), "transpose_copy": lambda x, y: x.t().contiguous(),
}
NUMERIC = {
    "add": lambda x, y: x + y, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y,
    "add_scalar": lambda x, y: x + 3, "neg": lambda x, y: -x, "abs": lambda x, y: x.abs(),
    "row_sum": lambda x, y: x.sum(1), "maximum": lambda x, y: torch.maximum(x, y),
}
BY_KIND = {
    "float": {"div": lambda x, y: x / y, "exp": lambda x, y: x.exp(), "mean": lambda x, y: x.mean(0),
              "mm": lambda x, y: x @ y.t(), "softmax": lambda x, y: x.softmax(-1)},
    "int": {"floordiv": lambda x, y: x // y, "remainder": lambda x, y: x % y, "and": lambda x, y: x & y},
    "bool": {"add": lambda x, y: x + y, "mul": lambda x, y: x * y, "and": lambda x, y: x & y,
             "or": lambda x, y: x | y, "not": lambda x, y: ~x, "any": lambda x, y: x.any(1)},
}


@pytest.mark.parametrize("dtype", FLOATS + INTS + [torch.bool], ids=str)
def test_dtype_ops_match_cpu(dev, dtype):
    kind = "bool" if dtype == torch.bool else "float" if dtype.is_floating_point else "int"
    cases = {**COMMON, **(NUMERIC if kind != "bool" else {}), **BY_KIND[kind]}
    _run(dev, cases, *_samples(dtype, torch.Generator().manual_seed(0)))


NAN_AWARE = {  # ops whose kernels test for NaN, which TVM's isnan does not take in bfloat16
    "max_pool2d": lambda x: F.max_pool2d(x, 2, return_indices=True),
    "adaptive_max_pool2d": lambda x: F.adaptive_max_pool2d(x, 3, return_indices=True),
    "argmax": lambda x: x.argmax(-1), "argmin": lambda x: x.argmin(1), "max_dim": lambda x: x.max(-1),
    "isnan": torch.isnan, "isinf": torch.isinf, "isfinite": torch.isfinite, "clamp": lambda x: x.clamp(-0.5, 0.5),
    "fmax": lambda x: torch.fmax(x, x.flip(-1)), "cummax": lambda x: x.cummax(-1),
    "scatter_amax": lambda x: torch.zeros_like(x).scatter_reduce(-1, torch.zeros_like(x, dtype=torch.long), x, "amax"),
}


@pytest.mark.parametrize("name", NAN_AWARE)
def test_bfloat16_nan_aware_ops_lower_and_match_cpu(dev, name):
    """In bfloat16, with a NaN and an infinity among the values: PyTorch's results, computed in TVM."""
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0)).bfloat16()
    x[0, 0, 0, 1], x[1, 2, 3, 3] = float("nan"), float("inf")
    want, got = NAN_AWARE[name](x), NAN_AWARE[name](x.to(dev))
    want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    for w, g in zip(want, got):
        torch.testing.assert_close(g.cpu(), w, equal_nan=True)
    if ON_CPU or name not in ("cummax", "scatter_amax"):  # host-loop kernels: PyTorch's on the GPU
        assert _fallbacks() == []


def test_type_promotion_matches_pytorch(dev):
    cases = {
        "int+float": lambda i, f, m: i + f,
        "int+float_scalar": lambda i, f, m: i + 1.5,
        "int*float_scalar": lambda i, f, m: i * 2.5,
        "int/int": lambda i, f, m: i / 3,
        "int/int_tensor": lambda i, f, m: i / (i.abs() + 1),
        "int32+int64": lambda i, f, m: i.int() + i,
        "int+0dim_float": lambda i, f, m: i + torch.tensor(0.25).to(i.device),
        "f16+f32": lambda i, f, m: f.half() + f,
        "bf16+f16": lambda i, f, m: f.bfloat16() + f.half(),
        "f16+0dim_f64": lambda i, f, m: f.half() + torch.tensor(2.5, dtype=torch.float64).to(f.device),
        "f32*f64": lambda i, f, m: f * f.double(),
        "bool*float": lambda i, f, m: m * f,
        "bool+int": lambda i, f, m: m + i,
        "bool+bool": lambda i, f, m: m + m,
        "masked_fill": lambda i, f, m: f.masked_fill(m, -1.0),
        "where_scalar": lambda i, f, m: torch.where(m, f, 0.0),
        "comparison_of_comparisons": lambda i, f, m: (f > 0) == m,
        "compare_int_float": lambda i, f, m: i < f,
        "bool_sum": lambda i, f, m: m.sum(),
        "int_mean_as_float": lambda i, f, m: i.float().mean(),
    }
    g = torch.Generator().manual_seed(1)
    f = torch.randn(3, 4, generator=g)
    _run(dev, cases, torch.randint(-9, 9, (3, 4), generator=g), f, torch.randn(3, 4, generator=g) > 0)


def test_to_bfloat16_rounds_after_each_op(dev, tmp_path, monkeypatch):
    """After .to(bfloat16), each op's result is a bfloat16 tensor: computed at float32 and rounded
    once, as PyTorch's CPU kernels do (the product by PyTorch's own kernel), so equal to CPU's."""
    monkeypatch.setattr(config, "SAVE_IR", str(tmp_path / "ir.txt"))
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(4, 8, generator=g), torch.randn(6, 8, generator=g)

    def fn(x, w):
        return torch.relu(x.to(torch.bfloat16) @ w.to(torch.bfloat16).t() * 0.5 + 1)

    got = fn(x.to(dev), w.to(dev))
    lm.mark_step()
    want = fn(x, w)
    assert got.dtype == torch.bfloat16 and torch.equal(got.cpu(), want)
    relax_text = (tmp_path / "ir.txt").read_text().split("-- Relax", 1)[1]
    assert re.search(r'ratex\.lib\.mm_out.*dtype="bfloat16"', relax_text), relax_text
    computed = re.findall(r"(lv\d+): R\.Tensor\(\(4, 6\), dtype=\"float32\"\) = R\.(?:multiply|add)\(", relax_text)
    assert len(computed) == 2, relax_text
    for var in computed:  # each result rounded to bfloat16 before the next op reads it
        assert re.search(rf"call_tir\(cls\._round_to_bf16_te\d*, \({var},\)", relax_text), (var, relax_text)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_linear_relu_forward_backward(dev, dtype):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(dtype)
    model = copy.deepcopy(ref).to(dev)
    x = torch.randn(5, 8).to(dtype)

    def step(m, x):
        out = m(x)
        out.float().square().mean().backward()
        return [out] + [p.grad for p in m.parameters()]

    got = step(model, x.to(dev))
    lm.mark_step()
    for a, b in zip(got, step(ref, x)):
        assert a.dtype == dtype
        torch.testing.assert_close(a.cpu(), b, rtol=3e-2, atol=3e-2)
    assert _fallbacks() == []


def test_clipped_foreach_adam_with_scheduler_syncs_only_at_mark_step(dev):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = copy.deepcopy(ref).to(dev)

    def make(m):
        opt = torch.optim.Adam(m.parameters(), lr=1e-2, foreach=True)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    def train(m, opt, sched, x, y, d):
        opt.zero_grad()
        loss = F.cross_entropy(m(x.to(d)), y.to(d))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.5)  # foreach norms and scaling
        opt.step()
        sched.step()
        return loss

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(5, 8, generator=g), torch.randint(0, 4, (5,), generator=g)) for _ in range(6)]
    opt, sched = make(model)
    losses = []
    for x, y in batches:
        losses.append(train(model, opt, sched, x, y, dev))
        lm.mark_step()
    lm.wait_device_ops()
    assert metrics.metric_data("ExecuteTime")[0] == len(batches)  # no other program ran: no sync in a step
    assert metrics.counter_value("UncachedCompile") == 1  # its zero state is data: every step runs one program
    assert _fallbacks() == []
    ref_opt, ref_sched = make(ref)
    for (x, y), loss in zip(batches, losses):
        torch.testing.assert_close(loss.cpu(), train(ref, ref_opt, ref_sched, x, y, "cpu"), rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5)


def _ulps(got, want):
    """Per element: how many steps of `want`'s dtype apart two tensors of that dtype are."""
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16}[want.dtype]
    return (got.view(bits).int() - want.view(bits).int()).abs()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_layer_norm_pow_and_embedding_round_like_pytorch(dev, dtype):
    """Computed in float32 and rounded where PyTorch's CPU kernels round: layer_norm's output and
    input gradient once; pow once, with the exponent in the tensor's dtype (bfloat16's x^3 and
    x^-2: after each product); embedding's gradient row by row. Each result equals CPU's to the
    bit (float16: within a step); layer_norm's weight and bias gradients, summed over rows in
    float32, are within a step of the exact sum (PyTorch's CPU kernel adds them up in `dtype`,
    in an order its thread count decides)."""
    torch.manual_seed(0)
    x, g = torch.randn(16, 48).to(dtype), torch.randn(16, 48).to(dtype)
    w, b = torch.randn(48).to(dtype), torch.randn(48).to(dtype)
    idx = torch.randint(0, 10, (40,))
    rows = torch.randn(40, 8).to(dtype)
    aten = torch.ops.aten

    def run(x, w, b, g, idx, rows):
        x, w, b = (t.detach().requires_grad_() for t in (x, w, b))
        y = F.layer_norm(x, [48], w, b)
        gx, gw, gb = torch.autograd.grad(y, (x, w, b), g)
        a = x.detach().abs()
        powers = [a.pow(e) for e in (3, -2, 2, 2.3, -1.3, 0.5)] + [a.pow(g.abs() * 2)]
        embedding = [aten.embedding_dense_backward(rows, idx, 10, -1, False),
                     aten.embedding_dense_backward(rows, idx, 10, 3, True)]
        return [y, gx, *powers, *embedding], [gw, gb]

    metrics.reset()
    got, got_sums = run(*(t.to(dev) for t in (x, w, b, g, idx, rows)))
    got, got_sums = [t.detach().cpu() for t in got], [t.detach().cpu() for t in got_sums]
    assert not _fallbacks(), _fallbacks()
    want, _ = run(x, w, b, g, idx, rows)
    for a, e in zip(got, want):
        assert a.dtype == dtype and _ulps(a, e.detach()).max() <= (1 if dtype == torch.float16 else 0)
    _, mean, rstd = aten.native_layer_norm(x, [48], w, b, 1e-5)  # rounded to `dtype`, as autograd saves them
    g64 = g.double()
    xhat = (x.double() - mean.double()) * rstd.double()
    for a, e in zip(got_sums, [(g64 * xhat).sum(0), g64.sum(0)]):
        assert _ulps(a, e.to(dtype)).max() <= 1


class _TinyBf16LM(torch.nn.Module):
    """GPT-2's pieces that a hand-cast bfloat16 model runs: token and position embeddings, layer
    norms, gelu_new (with x.pow(3)), an untied LM head."""

    def __init__(self, vocab=50, d=16, seq=8):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(vocab, d), torch.nn.Embedding(seq, d)
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.up, self.down, self.head = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d), torch.nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        u = self.up(self.ln1(h))
        u = 0.5 * u * (1.0 + torch.tanh(0.7978845608 * (u + 0.044715 * torch.pow(u, 3.0))))
        return self.head(self.ln2(h + self.down(u)))


def test_bfloat16_language_model_trains_in_tvm(dev):
    """model.bfloat16() by hand: three SGD steps, one compile, nothing on CPU, losses near CPU's."""
    torch.manual_seed(0)
    ref = _TinyBf16LM().bfloat16()
    lazy = copy.deepcopy(ref).to(dev)
    batches = [(torch.randint(0, 50, (4, 8)),) for _ in range(3)]
    compiles = []
    history = train_side_by_side(
        lazy, ref, lambda p: torch.optim.SGD(p, lr=0.1), batches,
        lambda m, ids: F.cross_entropy(m(ids).float().view(-1, 50), ids.view(-1)), dev,
        on_step=lambda: compiles.append(metrics.counter_value("UncachedCompile")))
    for losses in history:
        torch.testing.assert_close(*losses, rtol=2e-2, atol=1e-2)
    assert not _fallbacks(), _fallbacks()
    assert len(set(compiles)) == 1, compiles


def test_bfloat16_losses_and_softmax_gradient_sum_in_float32(dev):
    """nll_loss, mse_loss and softmax's backward over many bfloat16 terms sum in float32 and round
    once, as PyTorch's CPU kernels do: a bfloat16 running sum stops growing (a language model's
    mean cross-entropy of 7.4 over 1024 tokens came out 16). One rounding: 2^-8 relative, and
    PyTorch's own sum may land a step off the exact mean."""
    torch.manual_seed(0)
    logits, target = torch.randn(1024, 100).bfloat16(), torch.randint(0, 100, (1024,))
    a, b = torch.randn(256, 64).bfloat16(), torch.randn(256, 64).bfloat16()
    lazy = logits.to(dev).requires_grad_()
    loss = F.cross_entropy(lazy, target.to(dev))
    loss.backward()
    mse = F.mse_loss(a.to(dev), b.to(dev))
    lm.mark_step()
    cpu = logits.clone().requires_grad_()
    want = F.cross_entropy(cpu, target)
    want.backward()
    torch.testing.assert_close(loss.cpu(), want, rtol=2 ** -7, atol=0)
    torch.testing.assert_close(lazy.grad.cpu(), cpu.grad, rtol=2 ** -7, atol=2 ** -7 * cpu.grad.abs().max().item())
    torch.testing.assert_close(mse.cpu(), F.mse_loss(a, b), rtol=2 ** -7, atol=0)
    assert not _fallbacks(), _fallbacks()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_0dim_tensor_times_a_float_keeps_its_dtype(dev, dtype):
    """A 0-dim half tensor times or over a Python float stays half, as in PyTorch: the float is not
    lifted to a float32 0-dim input (CPU reads it at float32 precision) there, which would promote
    the result to float32."""
    x = torch.tensor(1.7, dtype=dtype)
    cases = {"mul": lambda t: t * 0.3, "div": lambda t: t / 0.7, "rmul": lambda t: 0.3 * t,
             "mul_1d": lambda t: t.expand(3) * 0.3}
    for name, fn in cases.items():
        want, got = fn(x), fn(x.to(dev)).cpu()
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
