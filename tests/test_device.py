"""The lazy device as users meet it: devices, printing, sync points, bad input."""
import os
import subprocess
import sys

import pytest
import torch

import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex.lazy_tensor_core.debug import metrics


def test_tensors_report_lazy_device(dev):
    assert torch.ones(1).to("lazy").device == torch.device("lazy", 0)
    assert torch.randn(2, 2, device="lazy").device == dev
    model = torch.nn.Linear(3, 2).to("lazy")
    assert all(p.device == dev for p in model.parameters())
    assert lm.lazy_device() == dev
    assert lm.is_lazy_tensor(model.weight) and not lm.is_lazy_tensor(torch.ones(1))


def test_print_and_materialize(dev):
    cpu = torch.tensor([[1.5, -2.0], [3.0, 4.0]])
    t = cpu.to(dev) * 2
    text = repr(t)
    assert "device='lazy:0'" in text and "3." in text and "-4." in text
    torch.testing.assert_close(t.cpu(), cpu * 2)
    torch.testing.assert_close(t.to("cpu"), cpu * 2)
    assert t.tolist() == (cpu * 2).tolist()
    assert t.sum().item() == pytest.approx(13.0)
    assert bool((t > 7).any()) is True
    assert t.cpu().device.type == "cpu"


def test_materialized_value_is_not_recomputed(dev):
    a = torch.randn(4, device=dev)
    b = a * 3
    b.cpu()
    before = metrics.counter_value("UncachedCompile") or 0
    before += metrics.counter_value("CachedCompile") or 0
    b.cpu()
    after = (metrics.counter_value("UncachedCompile") or 0) + (metrics.counter_value("CachedCompile") or 0)
    assert after == before


def add_two_maybe(t: torch.Tensor, maybe: torch.Tensor):
    if maybe:
        return t + 2
    return t


@pytest.mark.parametrize("maybe", [False, True])
def test_ltc_tutorial_control_flow(dev, maybe):
    t = torch.ones(1, device=dev)
    flag = torch.BoolTensor([maybe]).to(dev)
    out = add_two_maybe(t, flag)
    lm.mark_step()
    torch.testing.assert_close(out.cpu(), add_two_maybe(torch.ones(1), torch.BoolTensor([maybe])))


def test_pytorch_on_accelerators_examples(dev):
    t0, t1 = torch.randn(2, 2), torch.randn(2, 2)
    torch.testing.assert_close((t0.to(dev) + t1.to(dev)).cpu(), t0 + t1)
    torch.testing.assert_close(t0.to(dev).mm(t1.to(dev)).cpu(), t0.mm(t1))
    torch.manual_seed(0)
    linear = torch.nn.Linear(10, 20)
    l_in = torch.randn(10)
    want = linear(l_in)
    got = linear.to(dev)(l_in.to(dev))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)


def test_cpu_module_on_lazy_input_raises(dev):
    with pytest.raises(RuntimeError, match=r"lazy:0.*cpu|cpu.*lazy:0"):
        torch.nn.Linear(10, 20)(torch.randn(10, device=dev))


def test_mixing_with_cpu_tensor_raises_but_cpu_scalars_work(dev):
    x = torch.randn(3, device=dev)
    with pytest.raises(RuntimeError, match="lazy:0 and cpu"):
        x + torch.randn(3)
    torch.testing.assert_close((x * torch.tensor(2.0)).cpu(), x.cpu() * 2)


def test_shape_errors_raise_at_the_op(dev):
    a, b = torch.randn(2, 3, device=dev), torch.randn(4, device=dev)
    with pytest.raises(RuntimeError, match="broadcast"):
        a + b
    with pytest.raises(RuntimeError):
        a.mm(torch.randn(2, 3, device=dev))


def test_fallback_op_is_correct_and_counted(dev):
    x = torch.rand(5) + 0.5
    got = torch.special.airy_ai(x.to(dev) * 2) + 1
    torch.testing.assert_close(got.cpu(), torch.special.airy_ai(x * 2) + 1)
    # airy_ai has no lowering rule (nor a decomposition): it runs on CPU between lowered ops
    assert "aten::special_airy_ai.default" in metrics.counter_names(), metrics.counter_names()
    assert "ratex::mul.Tensor" in metrics.counter_names() and "ratex::add.Tensor" in metrics.counter_names()


def test_bad_ratex_device_fails_at_import():
    env = dict(os.environ, RATEX_DEVICE="TPU")
    proc = subprocess.run([sys.executable, "-c", "import ratex"], env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "RATEX_DEVICE='TPU'" in proc.stderr and "CPU, GPU" in proc.stderr


_OTHER_INDEX = {
    "factory": lambda t: torch.ones(2, device="lazy:1"),
    "random factory": lambda t: torch.randn(2, device=torch.device("lazy", 1)),
    "tensor": lambda t: torch.tensor([1.0, 2.0], device="lazy:1"),
    "arange": lambda t: torch.arange(3, device="lazy:1"),
    "like": lambda t: torch.zeros_like(t, device="lazy:1"),
    "random like": lambda t: torch.rand_like(t, device="lazy:1"),
    "new_": lambda t: t.new_ones(2, device="lazy:1"),
    "cpu to": lambda t: torch.ones(2).to("lazy:1"),
    "lazy to": lambda t: t.to("lazy:1"),
    "lazy to with dtype": lambda t: t.to("lazy:1", torch.float64),
    "module to": lambda t: torch.nn.Linear(2, 2).to("lazy:1"),
    "lazy_device": lambda t: lm.lazy_device(1),
}


@pytest.mark.parametrize("how", list(_OTHER_INDEX))
def test_a_lazy_device_index_other_than_0_raises_everywhere(dev, how):
    t = torch.ones(2, device=dev)
    with pytest.raises(ValueError, match=r"lazy device index 1 .*does not exist; ratex has one lazy device"):
        _OTHER_INDEX[how](t)
    assert torch.ones(2, device="lazy:0").device == dev and t.to("lazy:0") is t


def test_factories_and_indexing_with_python_and_cpu_indices(dev):
    t = torch.tensor([[1.0, 2.0, 3.0]], device=dev)
    assert t.device == dev
    x = torch.arange(6.0).to(dev)
    torch.testing.assert_close(x[[1, 4]].cpu(), torch.tensor([1.0, 4.0]))
    torch.testing.assert_close(x[torch.tensor([0, 5])].cpu(), torch.tensor([0.0, 5.0]))
    x[torch.tensor([2])] = 9
    torch.testing.assert_close(x.cpu(), torch.tensor([0.0, 1.0, 9.0, 3.0, 4.0, 5.0]))
    assert torch.zeros(2, 3, device=dev, dtype=torch.int32).sum().item() == 0


def test_signed_zero_and_nan_scalars_in_the_compile_cache(dev):
    """-0.0 == 0.0 (same hash) and NaN != NaN: a cached program must not be reused across the
    sign of a zero, and a NaN argument must hit the cache rather than compile every time."""
    aten = torch.ops.aten
    x = torch.tensor([1.0, -2.0])
    for divisor in (0.0, -0.0, 0.0):
        got = aten.div.Scalar(x.to(dev), divisor).cpu()
        assert torch.equal(got, aten.div.Scalar(x, divisor)), (divisor, got)
    for factor in (0.0, -0.0, 0.0):  # lifted to graph inputs, whose data is shared per value
        got = (x.to(dev) * factor).cpu()
        assert torch.equal(torch.signbit(got), torch.signbit(x * factor)), (factor, got)
    metrics.reset()
    for _ in range(3):
        assert torch.isnan(torch.full((2,), float("nan"), device=dev).cpu()).all()
    assert metrics.counter_value("UncachedCompile") in (None, 1)


def test_ops_with_value_dependent_shapes_or_new_metadata_run_on_cpu(dev):
    """repeat_interleave with a tensor of repeats (its size depends on the values) and resize_
    (it changes the tensor's shape) fall back to CPU PyTorch instead of raising."""
    x, reps = torch.arange(6.0).reshape(2, 3), torch.tensor([1, 3])
    got = torch.repeat_interleave(x.to(dev), reps.to(dev), dim=0)
    assert torch.equal(got.cpu(), torch.repeat_interleave(x, reps, dim=0))
    y = torch.arange(125.0).reshape(5, 5, 5)
    yl = y.to(dev)
    yl.resize_(25, 5)
    assert yl.shape == (25, 5) and torch.equal(yl.cpu(), y.clone().resize_(25, 5))


def test_long_run_without_mark_step_keeps_the_pending_list_short(dev, monkeypatch):
    """The list of pending storages is compacted to one entry per live storage; a tensor
    written many times between syncs must not grow it without bound (or compact it on every
    write), and the value stays the one CPU PyTorch computes."""
    from ratex.core import storage

    lm.mark_step()
    monkeypatch.setattr(storage, "_COMPACT_MIN", 50)
    monkeypatch.setattr(storage, "_compact_at", 50)
    x, other = torch.zeros(3), torch.ones(3)
    lx, lother = x.to(dev), other.to(dev)
    lother.mul_(2.0)  # a second live pending storage, which compaction must keep
    for i in range(300):
        x.add_(i)
        lx.add_(i)
        assert len(storage._pending) <= 100, (i, len(storage._pending))
    assert torch.equal(lx.cpu(), x)
    assert torch.equal(lother.cpu(), other * 2.0)
    many = [t.to(dev) * 3.0 for t in torch.ones(40, 2)]  # 40 more live pending storages
    for i in range(100):
        lx.add_(i)
    assert storage._compact_at > 50  # raised while they live: compacting again would keep them all
    lm.mark_step()
    assert storage._compact_at == 50  # the next run between syncs starts from the minimum again
    assert torch.equal(many[-1].cpu(), torch.full((2,), 3.0))
