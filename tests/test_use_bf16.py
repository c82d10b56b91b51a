"""RATEX_USE_BF16 (alias LTC_USE_BF16; torch_xla's XLA_USE_BF16): float32 tensors are float32 for
the user and bfloat16 on the device. The setting is fixed when ratex is imported, so the runs under
it are subprocesses: one runs every scenario of this module and reports what it saw."""
import json
import os
import subprocess
import sys

import pytest
import torch
import tvm

import tvm_lowering
from ratex import config
from ratex.core import executor
from ratex.core.device import CPUBackend, DLPackBackend
from ratex.core.graph import cut, to_fx
from ratex.core.tensor import LazyTensor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The scenarios, run under the setting; each reports the values the tests compare with CPU PyTorch.
_SCENARIOS = r"""
import copy, json, torch, ratex
import torch.nn.functional as F
import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex.lazy_tensor_core.debug import metrics
from ratex import config

torch.manual_seed(0)
out = {"use_bf16": config.USE_BF16}
x = torch.randn(6, 8)
lx = x.to("lazy")
out["dtype"] = str(lx.dtype)
out["read_dtype"] = str(lx.cpu().dtype)
out["round_trip"] = lx.cpu().tolist()
out["x"] = x.tolist()
out["full"] = torch.full((2,), 0.1, device="lazy").cpu().tolist()
xd = torch.randn(5, dtype=torch.float64)
yd = (xd.to("lazy") * 3).sin()
out["f64"] = [str(yd.dtype), yd.cpu().tolist(), xd.tolist()]
y = (lx * 3 + 1).relu()
lm.mark_step()
out["ops"] = [str(y.dtype), y.cpu().tolist()]

# An op without a lowering rule runs on CPU PyTorch: on float32 copies, its results stored back.
metrics.reset()
k = torch.kthvalue(lx, 2, dim=1).values * 3
out["fallback"] = [k.cpu().tolist(), metrics.counter_value("aten::kthvalue.default")]
bits = lx.view(torch.int32) + 0  # the bits of a float32 the device holds as bfloat16
out["view_dtype"] = [str(bits.dtype), bits.cpu().tolist()]

# Training: Linear/LayerNorm/ReLU, softmax cross-entropy, AdamW.
torch.manual_seed(1)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
out["init"] = [p.detach().flatten().tolist() for p in model.parameters()]
target = torch.randint(0, 4, (6,))
lazy = copy.deepcopy(model).to("lazy")
opt = torch.optim.AdamW(lazy.parameters(), lr=1e-2)
lt = target.to("lazy")
metrics.reset()
losses = []
for _ in range(5):
    loss = F.cross_entropy(lazy(lx), lt)
    loss.backward()
    opt.step()
    opt.zero_grad()
    lm.mark_step()
    losses.append(loss)
out["train"] = {
    "losses": [l.item() for l in losses],
    "params": [p.cpu().flatten().tolist() for p in lazy.parameters()],
    "param_dtypes": [str(p.dtype) for p in lazy.parameters()],
    "fallbacks": [n for n in metrics.counter_names() if n.startswith("aten::")],
}
out["target"] = target.tolist()

# ratex.jit.script: the script computes in float32 between the device's bfloat16 data.
torch.manual_seed(2)
small = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.Tanh())
out["script_init"] = [p.detach().flatten().tolist() for p in small.parameters()]
lsmall = copy.deepcopy(small).to("lazy")
scripted = ratex.jit.script(lsmall)
metrics.reset()
res = scripted(lx)
res.sum().backward()
lm.mark_step()
out["script"] = {
    "out": res.cpu().tolist(),
    "grad": lsmall[0].weight.grad.cpu().tolist(),
    "fallbacks": [n for n in metrics.counter_names() if n.startswith("aten::")],
}
print("RESULT " + json.dumps(out))
"""


def _run(script, **env):
    """Run `script` in a fresh process with `env` added; return its RESULT json."""
    full = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    for name in ("RATEX_USE_BF16", "LTC_USE_BF16"):
        if name not in env:
            full.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def run():
    """The scenarios' report under RATEX_USE_BF16=1 (one process: the module compiles once)."""
    return _run(_SCENARIOS, RATEX_USE_BF16="1")


def _bf16(values) -> torch.Tensor:
    """`values` rounded to bfloat16, as float32: what the device holds of a float32 tensor."""
    return torch.tensor(values).bfloat16().float()


def test_dtype_is_float32_and_reads_are_float32(run):
    assert run["use_bf16"] is True
    assert run["dtype"] == "torch.float32" and run["read_dtype"] == "torch.float32"
    assert run["ops"][0] == "torch.float32"


def test_round_trip_rounds_to_bfloat16(run):
    x = torch.tensor(run["x"])
    got = torch.tensor(run["round_trip"])
    assert torch.equal(got, x.bfloat16().float())
    assert not torch.equal(got, x)  # randn values are not bfloat16 values: the device rounded them
    assert torch.equal(torch.tensor(run["full"]), _bf16([0.1, 0.1]))


def test_ops_compute_in_bfloat16(run):
    xb = torch.tensor(run["x"]).bfloat16()
    assert torch.equal(torch.tensor(run["ops"][1]), (xb * 3 + 1).relu().float())


def test_float64_stays_float64(run):
    dtype, got, x = run["f64"]
    assert dtype == "torch.float64"
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                               (torch.tensor(x, dtype=torch.float64) * 3).sin(), rtol=1e-12, atol=1e-12)


def test_eager_fallback_sees_float32_and_stores_bfloat16(run):
    values, count = run["fallback"]
    assert count == 1
    xb = torch.tensor(run["x"]).bfloat16()
    assert torch.equal(torch.tensor(values), (torch.kthvalue(xb.float(), 2, dim=1).values.bfloat16() * 3).float())


def test_view_as_int32_sees_the_bfloat16_value(run):
    dtype, bits = run["view_dtype"]
    assert dtype == "torch.int32"
    assert torch.equal(torch.tensor(bits, dtype=torch.int32), torch.tensor(run["x"]).bfloat16().float().view(torch.int32))


def _reference(run, dtype):
    """Losses and parameters of the scenario's training on CPU PyTorch in `dtype`."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    with torch.no_grad():
        for p, init in zip(model.parameters(), run["init"]):
            p.copy_(torch.tensor(init).reshape(p.shape))
    model = model.to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, target = torch.tensor(run["x"]).to(dtype), torch.tensor(run["target"])
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.cross_entropy(model(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return torch.tensor(losses), torch.cat([p.detach().float().flatten() for p in model.parameters()])


def test_training_matches_bfloat16_reference(run):
    train = run["train"]
    assert train["param_dtypes"] == ["torch.float32"] * 6 and train["fallbacks"] == []
    losses = torch.tensor(train["losses"])
    params = torch.cat([torch.tensor(p) for p in train["params"]])
    ref_losses, ref_params = _reference(run, torch.bfloat16)
    f32_losses, f32_params = _reference(run, torch.float32)
    # Every value the device holds is a bfloat16 value; a float32 run's would not be.
    assert torch.equal(params, params.bfloat16().float()) and torch.equal(losses, losses.bfloat16().float())
    assert not torch.equal(f32_params, f32_params.bfloat16().float())
    # bfloat16 keeps 8 significant bits: one rounding step is 2^-8 relative. The two programs
    # round the same ops in a different order (matmul and norm reductions accumulate in float32
    # in both, summed in another order), so a loss may land one or two steps apart: 2^-6.
    torch.testing.assert_close(losses, ref_losses, rtol=2 ** -6, atol=0)
    # Parameters: most end where the reference's do, to a bfloat16 step (2^-7 relative, bounding
    # both values). AdamW moves each weight about lr per step whatever its gradient's size, so where
    # a gradient is near zero its sign is rounding noise and that step lands up to 2 * lr away.
    diff = (params - ref_params).abs()
    step = params.abs().maximum(ref_params.abs()) * 2 ** -7
    assert (diff <= step).float().mean() >= 0.75, (diff <= step).float().mean()
    assert diff.max() <= 2 * 1e-2 + step.max(), diff.max()


def test_jit_script_under_bf16(run):
    """The script's Relax functions take float32: the call casts the bfloat16 data to them and its
    results back, instead of falling back to CPU PyTorch."""
    script = run["script"]
    assert script["fallbacks"] == []
    torch.manual_seed(2)
    small = torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.Tanh())
    with torch.no_grad():
        for p, init in zip(small.parameters(), run["script_init"]):
            p.copy_(_bf16(init).reshape(p.shape))
    x = _bf16(run["x"]).requires_grad_(False)
    ref = small(x)
    ref.sum().backward()
    # float32 arithmetic on the bfloat16 inputs, then one rounding to bfloat16 (2^-8 relative);
    # the float32 results may differ in their last bits, which can move a rounding by one step.
    for got, want in ((script["out"], ref.detach()), (script["grad"], small[0].weight.grad)):
        got = torch.tensor(got)
        torch.testing.assert_close(got, want.bfloat16().float(), rtol=2 ** -7, atol=1e-6)
        assert torch.equal(got, got.bfloat16().float())


_ALIAS = r"""
import json, torch, ratex
from ratex import config
x = torch.tensor([0.1, 1 / 3])
print("RESULT " + json.dumps([config.USE_BF16, torch.tensor([0.1, 1 / 3]).to("lazy").cpu().tolist()]))
"""


def test_ltc_alias():
    flag, values = _run(_ALIAS, LTC_USE_BF16="1")
    assert flag is True and torch.equal(torch.tensor(values), _bf16([0.1, 1 / 3]))


@pytest.mark.parametrize("raw, value", [("1", True), ("on", True), ("0", False), ("", False)])
def test_parsed_with_the_boolean_rule(monkeypatch, raw, value):
    monkeypatch.delenv("LTC_USE_BF16", raising=False)
    monkeypatch.setenv("RATEX_USE_BF16", raw)
    assert config._use_bf16() is value
    monkeypatch.delenv("RATEX_USE_BF16")
    monkeypatch.setenv("LTC_USE_BF16", raw)
    assert config._use_bf16() is value


@pytest.mark.parametrize("name", ["RATEX_USE_BF16", "LTC_USE_BF16"])
def test_bad_value_names_the_variable(monkeypatch, name):
    monkeypatch.delenv("RATEX_USE_BF16", raising=False)
    monkeypatch.delenv("LTC_USE_BF16", raising=False)
    monkeypatch.setenv(name, "bf16")
    with pytest.raises(ValueError, match=f"{name}='bf16' is not valid; use true or false"):
        config._use_bf16()


def test_disagreeing_names_raise(monkeypatch):
    monkeypatch.setenv("RATEX_USE_BF16", "1")
    monkeypatch.setenv("LTC_USE_BF16", "off")
    with pytest.raises(ValueError, match="RATEX_USE_BF16='1' and LTC_USE_BF16='off' disagree"):
        config._use_bf16()


def test_cache_key_is_salted(monkeypatch):
    """The same graph (its metas say float32) is another program under the setting."""
    x = LazyTensor.from_cpu(torch.ones(3))
    graph = cut([(x * 2)._value()])
    monkeypatch.setattr(config, "USE_BF16", False)
    plain = executor.cache_key(graph, (), False)
    monkeypatch.setattr(config, "USE_BF16", True)
    assert executor.cache_key(graph, (), False) != plain
    assert executor.cache_key(graph, ((0, 0),), True) != executor.cache_key(graph, ((0, 0),), False)


_CACHED = r"""
import json, torch, ratex
import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex.lazy_tensor_core.debug import metrics
y = (torch.tensor([0.1, 1 / 3, 2.7]).to("lazy") * 1.5).exp()
lm.mark_step()
print("RESULT " + json.dumps([y.cpu().tolist()] + [metrics.counter_value(n) or 0 for n in
                                                   ("UncachedCompile", "PersistentCacheHit")]))
"""


def test_disk_cache_keeps_float32_and_bf16_programs_apart(tmp_path):
    x = torch.tensor([0.1, 1 / 3, 2.7])
    f32 = (x * 1.5).exp()
    bf16 = ((x.bfloat16() * 1.5).exp()).float()
    values, compiled, hits = _run(_CACHED, RATEX_CACHE_DIR=str(tmp_path))
    torch.testing.assert_close(torch.tensor(values), f32)
    assert (compiled, hits) == (1, 0)
    values, compiled, hits = _run(_CACHED, RATEX_CACHE_DIR=str(tmp_path), RATEX_USE_BF16="1")
    assert torch.equal(torch.tensor(values), bf16) and (compiled, hits) == (1, 0)
    values, compiled, hits = _run(_CACHED, RATEX_CACHE_DIR=str(tmp_path), RATEX_USE_BF16="1")
    assert torch.equal(torch.tensor(values), bf16) and (compiled, hits) == (0, 1)
    values, compiled, hits = _run(_CACHED, RATEX_CACHE_DIR=str(tmp_path))
    torch.testing.assert_close(torch.tensor(values), f32)
    assert (compiled, hits) == (0, 1)


@pytest.mark.parametrize("backend", ["cpu", "dlpack"])
def test_backends_store_float32_as_bfloat16(monkeypatch, backend):
    """Data going in are rounded to bfloat16 (also a one-element upload, the DLPack backend's fill
    path); data coming out are widened to the dtype asked for; other dtypes pass untouched."""
    monkeypatch.setattr(config, "USE_BF16", True)
    be = CPUBackend() if backend == "cpu" else DLPackBackend(tvm_lowering.resolve_target("CPU"),
                                                              torch.device("cpu"), tvm.cpu())
    x = torch.randn(5, 3).t()  # not contiguous
    for data in (be.upload(x), be.adopt(x.clone()), be.upload(x[:1, :1])):
        assert data.dtype == torch.bfloat16
    data = be.upload(x)
    assert torch.equal(be.download(data, torch.float32), x.bfloat16().float())
    assert be.download(data).dtype == torch.bfloat16
    assert torch.equal(be.view_cpu(data, torch.float32), x.bfloat16().float())
    assert be.full((2,), 0.1, torch.float32).dtype == torch.bfloat16
    assert be.upload(x.double()).dtype == torch.float64 and be.upload(x.half()).dtype == torch.float16


def test_to_fx_writes_the_stored_dtype():
    """The lowered graph says bfloat16 wherever the user's says float32: metas and dtype= arguments."""
    x = LazyTensor.from_cpu(torch.ones(4, 3))
    y = x.sum(0, dtype=torch.float32) * 2
    graph = cut([y._value()])
    lowered = to_fx(graph, float32_as=torch.bfloat16)
    calls = [n for n in lowered.nodes if n.op in ("placeholder", "call_function")]
    assert all(n.meta["val"].dtype == torch.bfloat16 for n in calls if n.meta.get("val") is not None)
    assert any(n.kwargs.get("dtype") is torch.bfloat16 for n in calls)
    plain = to_fx(graph)
    assert all(n.meta["val"].dtype == torch.float32 for n in plain.nodes if n.meta.get("val") is not None)


def test_to_fx_refuses_bit_views_of_stored_float32():
    x = LazyTensor.from_cpu(torch.ones(4))
    graph = cut([x.view(torch.int32)._value()])
    with pytest.raises(tvm_lowering.LoweringError, match="RATEX_USE_BF16"):
        to_fx(graph, float32_as=torch.bfloat16)
    to_fx(graph)
