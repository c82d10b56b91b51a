"""Dtypes on the lazy device: each dtype's arithmetic, reductions and comparisons, PyTorch's
type promotion, bf16/fp16 compute (checked in the compiled Relax), and a clipped foreach-Adam
training loop with a scheduler that syncs only at mark_step. All against CPU PyTorch."""
import copy
import re

import pytest
import torch
import torch.nn.functional as F

import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex import config
from ratex.lazy_tensor_core.debug import metrics

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


def test_to_bfloat16_computes_in_bfloat16(dev, tmp_path, monkeypatch):
    monkeypatch.setattr(config, "SAVE_IR", str(tmp_path / "ir.txt"))
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(4, 8, generator=g), torch.randn(6, 8, generator=g)

    def fn(x, w):
        return torch.relu(x.to(torch.bfloat16) @ w.to(torch.bfloat16).t() * 0.5 + 1)

    got = fn(x.to(dev), w.to(dev))
    lm.mark_step()
    want = fn(x, w)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.cpu(), want, rtol=2e-2, atol=2e-2)
    relax_text = (tmp_path / "ir.txt").read_text().split("-- Relax", 1)[1]
    computed = [line for line in relax_text.splitlines() if re.search(r"R\.(multiply|add|nn\.relu|matmul)|ratex\.lib\.mm", line)]
    assert len(computed) == 4, relax_text
    assert all('dtype="bfloat16"' in line and "float32" not in line for line in computed), relax_text
    assert 'astype(' not in relax_text.split("permute_dims", 1)[1]  # nothing is cast back to float32


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
