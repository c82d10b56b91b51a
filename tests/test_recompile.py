"""Why a graph compiled again (RATEX_DEBUG, ratex.debug.explain), the warning after many compiles,
short_metrics_report, and ratex's counters under torch._lazy.metrics and LTC's names."""
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch._lazy.metrics

import ratex
import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex import config
from ratex.core import explain
from ratex.lazy_tensor_core.debug import metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def fresh():
    """No graphs compiled before: the first compile of the test is the process's first."""
    explain.clear()
    ratex.core.sync.reset_cache()
    yield
    explain.clear()


def _step(fn, *args):
    out = fn(*args)
    lm.mark_step()
    return out


def _last():
    return ratex.debug.explain()[-1]


def test_new_input_shapes_are_named(fresh, dev):
    w = torch.randn(8, 4).to(dev)
    _step(lambda x: (x @ w).relu(), torch.randn(3, 8).to(dev))
    assert ratex.debug.explain() == []  # the first graph explains nothing
    _step(lambda x: (x @ w).relu(), torch.randn(5, 8).to(dev))
    r = _last()
    assert r.cause == "input shapes"
    assert r.details == ["input 0: float32[3, 8] -> float32[5, 8]"]
    assert r.sync.startswith(__file__) and " in _step" in r.sync


def test_a_baked_in_constant_is_named_with_its_line(fresh, dev, monkeypatch):
    monkeypatch.setattr(config, "DEBUG", True)  # note the user lines that record ops
    x = torch.randn(4).to(dev)
    _step(lambda: x + 2)
    _step(lambda: x + 3)
    r = _last()
    assert r.cause == "constant"
    [detail] = r.details
    assert detail.startswith("op 0 add.Tensor at ") and "argument 2 -> 3, a constant" in detail
    assert f"{__file__}:" in detail and "in <lambda>" in detail


def test_the_first_different_op_is_named_with_its_line(fresh, dev, monkeypatch):
    monkeypatch.setattr(config, "DEBUG", True)
    x = torch.randn(4).to(dev)
    _step(lambda: (x * 2).relu())
    _step(lambda: (x * 2).sigmoid())
    r = _last()
    assert r.cause == "ops"
    [detail] = r.details
    assert detail.startswith("first different op: op 1 sigmoid at ") and detail.endswith(
        f"where graph {ratex.debug.explain()[-1].closest} has relu")
    assert f"{__file__}:" in detail


def test_optimizer_state_appearing_is_named_live_tensors(fresh, dev):
    """SGD with momentum: step 0 makes the buffers, step 1 reads them as inputs."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(3, 4, device=dev)).sum().backward()
        opt.step()
        lm.mark_step()
    [r] = ratex.debug.explain()  # step 2 is a cache hit
    assert r.cause == "live tensors"
    assert r.details[0].startswith("3 more inputs (new: ")
    assert "float32[2, 4]" in r.details[0] and "float32[2]" in r.details[0]


def test_a_tensor_kept_alive_is_named_live_tensors(fresh, dev, monkeypatch):
    monkeypatch.setattr(config, "DEBUG", True)
    w = torch.randn(8, 4).to(dev)
    x = torch.randn(5, 8).to(dev)
    _step(lambda: ((x @ w) + 3).relu())
    kept = x @ w
    y = (kept + 3).relu()  # noqa: F841
    lm.mark_step()
    r = _last()
    assert r.cause == "live tensors"
    assert r.details[0].startswith("1 more output (tensors live at the sync); new: op 0 mm at ")


def test_an_op_traced_through_its_decomposition_leaves_nothing_pending(dev):
    """multi_margin_loss has no meta kernel at the lazy device's level and is traced through
    torch._decomp: once its result is read, none of its intermediates may stay alive, pending, to
    join (and change) the graph of whatever step comes next."""
    x, y = torch.randn(5, 4).to(dev), torch.tensor([0, 3, 1, 1, 2]).to(dev)
    torch.nn.functional.multi_margin_loss(x, y).cpu()
    assert not ratex.core.sync.pending_storages()


def test_the_same_graph_after_the_cache_was_cleared(fresh, dev):
    x = torch.randn(4).to(dev)
    _step(lambda: x * 2)
    ratex.core.sync.reset_cache()
    _step(lambda: x * 2)
    assert _last().cause == "same graph"


def test_ratex_debug_prints_one_report_per_compile_after_the_first():
    code = (
        "import torch, ratex\n"
        "import ratex.lazy_tensor_core.core.lazy_model as lm\n"
        "for n in (3, 5, 5):\n"
        "    y = torch.ones(n).to('lazy') * 2\n"
        "    lm.mark_step()\n"
        "y = torch.ones(5).to('lazy') + 1\n"
        "lm.mark_step()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, RATEX_DEBUG="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [line for line in proc.stderr.splitlines() if line.startswith("ratex: compiled graph")]
    assert len(reports) == 2, proc.stderr  # n=5 twice is a cache hit; the first graph is silent
    assert reports[0].endswith("at <string>:5 in <module>")
    assert "  cause: input shapes (closest earlier graph: " in proc.stderr
    assert "  input 0: float32[3] -> float32[5]" in proc.stderr
    assert "  first different op: op 0 add.Tensor at <string>:6 in <module>, where graph " in proc.stderr


def test_a_warning_names_ratex_debug_after_many_compiles(fresh, dev, monkeypatch):
    monkeypatch.setattr(config, "WARN_COMPILES", explain._compiles[0] + 2)
    x = torch.randn(4).to(dev)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _step(lambda: x * 2)
        _step(lambda: x * 3)
        _step(lambda: x * 4)
    hints = [w for w in caught if "RATEX_DEBUG=1" in str(w.message)]
    assert len(hints) == 1, [str(w.message) for w in caught]
    assert hints[0].filename == __file__  # the user's sync point


def test_short_metrics_report_names_compiles_and_fallbacks(dev):
    x = torch.randn(4, 4).to(dev)
    torch.linalg.inv(x)  # no rule: runs on the CPU
    (x * 2).sum().item()
    lm.mark_step()
    report = metrics.short_metrics_report()
    assert "Counter: MarkStep" in report and "Counter: aten::linalg_inv_ex.default" in report
    assert "Metric: ExecuteTime" in report
    assert "ratex::mul.Tensor" not in report and "DeviceDataTransfer" not in report
    only = metrics.short_metrics_report(counter_names=["MarkStep"], metric_names=[])
    assert only.splitlines()[:2] == ["Counter: MarkStep", "  Value: 1"]


def test_torch_lazy_metrics_read_ratex_counters(dev):
    torch._lazy.metrics.reset()
    assert metrics.counter_names() == []
    y = torch.ones(3).to(dev) * 2
    torch._lazy.mark_step()
    assert "MarkStep" in torch._lazy.metrics.counter_names()
    assert torch._lazy.metrics.counter_value("MarkStep") == 1
    assert "Counter: MarkStep" in torch._lazy.metrics.metrics_report()
    assert torch._lazy.to_cpu([y])[0].tolist() == [2.0, 2.0, 2.0]  # torch._lazy.sync_multi is ratex's


def test_ltc_tensor_counters_count_creation_and_death(dev):
    x = torch.ones(3).to(dev)
    metrics.reset()
    ys = [x + k for k in range(4)]
    assert metrics.counter_value("CreateLtcTensor") == metrics.counter_value("CreateLazyTensor") >= 4
    assert metrics.counter_value("DestroyLtcTensor") is None
    created = metrics.counter_value("CreateLazyTensor")
    del ys
    assert metrics.counter_value("DestroyLtcTensor") == metrics.counter_value("DestroyLazyTensor") == created
    assert {"CreateLtcTensor", "DestroyLtcTensor"} <= set(metrics.counter_names())
