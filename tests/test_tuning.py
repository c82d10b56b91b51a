"""Auto-tuning (RATEX_TUNE): tuned kernels still compute what CPU PyTorch does, records persist across processes."""
import json
import os
import subprocess
import sys

import pytest
import tvm

from ratex import config
from tvm_lowering import tuning
from tvm_lowering.pipeline import resolve_target
from tvm_lowering.tuning import Tuner

pytestmark = pytest.mark.cpu_only("MetaSchedule tuning is for CPU kernels")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRIALS = "2"

# One training step of a tiny linear layer on the lazy device and on CPU; prints
# whether they agree, and the tuning counters.
SCRIPT = """
import json, torch, ratex
import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex.lazy_tensor_core.debug import metrics
torch.manual_seed(0)
ref = torch.nn.Linear(8, 4)
model = torch.nn.Linear(8, 4)
model.load_state_dict(ref.state_dict())
model.to(lm.lazy_device())
x = torch.randn(6, 8)
outs = []
for m, dev in ((ref, "cpu"), (model, lm.lazy_device())):
    loss = torch.relu(m(x.to(dev))).pow(2).mean()
    loss.backward()
    lm.mark_step()
    outs.append([loss.detach().cpu(), m.weight.grad.cpu(), m.bias.grad.cpu()])
match = all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(*outs))
names = ("TunedKernels", "TunedKernelsApplied", "PersistentCacheHit", "UncachedCompile")
print("RESULT", json.dumps({"match": match, **{n: metrics.counter_value(n) or 0 for n in names}}))
"""


def _run(cache_dir, tune=None):
    """Run SCRIPT with matmuls as TVM kernels and RATEX_TUNE=`tune` (None: unset); return its counters."""
    env = dict(os.environ, RATEX_CACHE_DIR=str(cache_dir), RATEX_KERNELS="tvm")
    env.pop("RATEX_TUNE", None)
    if tune is not None:
        env["RATEX_TUNE"] = tune
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    assert out["match"], "lazy results differ from CPU PyTorch"
    return out


def _drop_compiled_programs(cache_dir):
    """Remove the compiled programs, keeping the tuning records."""
    for name in os.listdir(cache_dir):
        if name.endswith((".json", ".so")):
            os.remove(cache_dir / name)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache dir where an untuned run stored its programs, then a RATEX_TUNE run tuned them."""
    cache = tmp_path_factory.mktemp("tuning") / "cache"
    untuned = _run(cache, None)
    untuned["made a database"] = (cache / "tuning").exists()
    tuned = _run(cache, TRIALS)
    return cache, untuned, tuned


def test_unset_means_no_tuning(cache):
    _, untuned, _ = cache
    assert not untuned["made a database"]
    assert untuned["TunedKernels"] == 0 and untuned["TunedKernelsApplied"] == 0
    assert untuned["UncachedCompile"] > 0


def test_tuning_runs_and_matches_pytorch(cache):
    path, untuned, tuned = cache
    # The untuned programs already on disk did not shadow the compile that tunes: the ones
    # with TVM kernels compiled again (a program without kernels, e.g. a graph that folded
    # to views, has nothing to tune and may load from disk).
    assert tuned["UncachedCompile"] > 0
    assert tuned["PersistentCacheHit"] < untuned["UncachedCompile"]
    assert tuned["TunedKernels"] > 0
    assert tuned["TunedKernelsApplied"] > 0
    assert os.listdir(path / "tuning")


def test_another_process_reuses_the_records(cache):
    path, _, tuned = cache
    _drop_compiled_programs(path)
    again = _run(path, TRIALS)  # compiles again, finds every kernel tuned
    assert again["UncachedCompile"] > 0 and again["TunedKernels"] == 0
    assert again["TunedKernelsApplied"] == tuned["TunedKernelsApplied"]


def test_tuned_programs_load_from_disk_without_tuning(cache):
    path, _, _ = cache
    loaded = _run(path, None)
    assert loaded["PersistentCacheHit"] > 0 and loaded["UncachedCompile"] == 0
    assert loaded["TunedKernels"] == 0


def test_entry_is_current_only_with_the_records_it_was_compiled_with(tmp_path):
    target = resolve_target("CPU").tvm
    applying = Tuner(str(tmp_path / "db"), target, trials=0)
    tuning = Tuner(str(tmp_path / "db"), target, trials=2)
    assert applying.is_current({"123": None})  # untuned kernel, nothing to tune: reuse
    assert not tuning.is_current({"123": None})  # a kernel to tune first
    assert not applying.is_current({"123": "4:1.0e-06"})  # records changed (here: gone)
    assert not os.path.exists(tmp_path / "db")  # checking never creates a database


@pytest.mark.parametrize("value", ["-1", "many", "2.5"])
def test_bad_values_are_refused(value, monkeypatch):
    monkeypatch.setenv("RATEX_TUNE", value)
    with pytest.raises(ValueError, match=f"RATEX_TUNE={value!r} is not valid"):
        config._tune_trials()


def test_tuning_needs_a_cache_dir(monkeypatch):
    monkeypatch.setenv("RATEX_TUNE", "2")
    monkeypatch.setattr(config, "CACHE_DIR", None)
    with pytest.raises(ValueError, match="RATEX_CACHE_DIR"):
        config._tune_trials()
    monkeypatch.setenv("RATEX_TUNE", "0")  # off: nothing to store
    assert config._tune_trials() == 0


def _gather_kernel():
    from tvm import te

    a = te.placeholder((64,), "float32", name="a")
    idx = te.placeholder((64,), "int64", name="idx")
    out = te.compute((64,), lambda i: a[idx[i]] + 1.0, name="out")  # a gather: needs in-bounds indices
    return te.create_prim_func([a, idx, out])


def _add_kernel_lib(path):
    tvm.tirx.build(tvm.IRModule({"main": _gather_kernel()}), "llvm").export_library(str(path))
    return {"lib": str(path), "args": [["TENSOR", "float32", [64]], ["TENSOR", "int64", [64]],
                                       ["TENSOR", "float32", [64]]], "number": 2, "min_repeat_ms": 1}


def test_worker_times_a_candidate_and_survives_a_crashing_one(tmp_path):
    runner = tuning._Runner()
    request = _add_kernel_lib(tmp_path / "add.so")
    try:
        costs = runner._ask(request)["costs"]
        assert len(costs) == 1 and 0 < costs[0] < 1
        runner.close()
        crash = "import os, sys; print('{}', flush=True); sys.stdin.readline(); os.abort()"
        runner.command = [sys.executable, "-c", crash]
        assert "crashed" in runner._ask(request)["error"]
        assert runner.proc is None  # the next candidate gets a new worker
    finally:
        runner.close()


def test_a_kernel_that_cannot_be_tuned_keeps_the_default_schedule(tmp_path, monkeypatch):
    def fails(*_args):
        raise RuntimeError("no schedule for you")

    monkeypatch.setattr(Tuner, "_tune_one", fails)
    mod = tvm.IRModule({"gather": _gather_kernel()})
    target = resolve_target("CPU").tvm
    report = tuning.Report()
    with pytest.warns(UserWarning, match="could not tune gather .*no schedule for you"):
        out = Tuner(str(tmp_path / "db"), target, trials=2).pass_(report)(mod)
    assert report.tuned == 1 and report.applied == 0
    assert "tirx.is_scheduled" not in out["gather"].attrs  # left to the default schedules
    again = tuning.Report()
    Tuner(str(tmp_path / "db"), target, trials=2).pass_(again)(mod)
    assert again.tuned == 0 and again.applied == 0  # the failure is remembered, not retried
