"""Saving and loading from the lazy device: lm.save, serialization.save/load (one tensor at a
time, with a bound on the memory it takes) and a training run resumed in a fresh process."""
import json
import os
import subprocess
import sys

import pytest
import torch

import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex.lazy_tensor_core.utils import serialization

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import save_memory  # noqa: E402


def _nested_state(dev):
    """A state with lazy tensors pending and computed, a CPU tensor, a tie and plain values."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 4, generator=g)
    lazy_w = torch.nn.Parameter(w.to(dev))
    pending = lazy_w.detach() * 2 + 1  # not computed until the save syncs
    state = {"model": {"w": lazy_w, "tied": lazy_w, "b": pending},
             "optimizer": {"state": {0: {"step": torch.tensor(3.0), "buf": [pending, torch.ones(2).to(dev)]}},
                           "param_groups": [{"lr": 0.1, "params": [0], "nesterov": False, "name": None}]},
             "epoch": 7}
    want = {"w": w, "b": w * 2 + 1}
    return state, want


def _check_loaded(loaded, want):
    assert loaded["epoch"] == 7
    assert loaded["optimizer"]["param_groups"] == [{"lr": 0.1, "params": [0], "nesterov": False, "name": None}]
    model, opt_state = loaded["model"], loaded["optimizer"]["state"][0]
    tensors = [model["w"], model["tied"], model["b"], opt_state["step"], *opt_state["buf"]]
    assert all(t.device.type == "cpu" and not lm.is_lazy_tensor(t) for t in tensors)
    torch.testing.assert_close(model["w"], want["w"], rtol=0, atol=0)
    torch.testing.assert_close(model["b"], want["b"])
    torch.testing.assert_close(opt_state["buf"][0], want["b"])
    torch.testing.assert_close(opt_state["buf"][1], torch.ones(2))
    assert opt_state["step"].item() == 3.0
    assert model["tied"].data_ptr() == model["w"].data_ptr()  # one tensor twice stays one tensor


def test_lm_save_moves_nested_lazy_state_to_the_cpu(dev, tmp_path):
    state, want = _nested_state(dev)
    lm.save(state, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    _check_loaded(loaded, want)
    assert isinstance(loaded["model"]["w"], torch.nn.Parameter) and loaded["model"]["w"].requires_grad
    assert lm.is_lazy_tensor(state["model"]["w"])  # the saved state itself stays on the device


def test_serialization_round_trip_one_tensor_per_file(dev, tmp_path):
    state, want = _nested_state(dev)
    path = tmp_path / "ckpt.pt"
    serialization.save(state, path)
    # four tensors: the tie and the pending tensor held twice are each written once
    assert sorted(os.listdir(str(path) + ".tensors")) == [f"tensor_{k}.pt" for k in range(4)]
    _check_loaded(serialization.load(path), want)
    serialization.save({"only": torch.zeros(1).to(dev)}, path)  # a new checkpoint replaces the old
    assert os.listdir(str(path) + ".tensors") == ["tensor_0.pt"]
    assert serialization.load(path)["only"].tolist() == [0.0]
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".saving")] == []


def test_serialization_load_names_a_file_it_did_not_write(dev, tmp_path):
    torch.save({"x": torch.ones(1)}, tmp_path / "plain.pt")
    with pytest.raises(FileNotFoundError, match=r"plain\.pt\.tensors is missing.*torch\.load"):
        serialization.load(tmp_path / "plain.pt")


def test_serialization_save_peaks_at_a_fraction_of_the_state():
    """A 128 MB state in 8 tensors: saving it one tensor at a time adds well under the state's
    size to the process's peak (the 1 GB case is scripts/save_memory.py)."""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("the peak resident set is read from /proc (Linux)")
    size = 128
    r = save_memory.measure("serialization.save", size, 8)
    assert r["extra_mb"] < 0.6 * size, r


# The training run: resumed in a fresh process from a checkpoint taken at step K, it goes on
# with the losses of the run that was not interrupted. Model, optimizer, LR schedule, data and
# dropout all depend on what the checkpoint holds.
TRAIN = """
import torch, torch.nn.functional as F
import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex.lazy_tensor_core.debug import metrics

def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.25),
                                torch.nn.Linear(16, 4)).to('lazy')
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8)

def step(model, opt, sched):
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    opt.zero_grad()
    loss = F.cross_entropy(model(x.to('lazy')), y.to('lazy'))
    loss.backward()
    opt.step()
    lm.mark_step()
    sched.step()
    return loss.item()

def state(model, opt, sched):
    return {'model': model.state_dict(), 'optimizer': opt.state_dict(), 'scheduler': sched.state_dict(),
            'rng': torch.get_rng_state()}

def resume(path, load, steps):
    model, opt, sched = build(seed=1)  # other initial weights: only the checkpoint makes them equal
    ckpt = load(path)
    model.load_state_dict(ckpt['model'])
    opt.load_state_dict(ckpt['optimizer'])
    sched.load_state_dict(ckpt['scheduler'])
    torch.set_rng_state(ckpt['rng'])
    losses, compiles = [], []
    for _ in range(steps):
        losses.append(step(model, opt, sched))
        compiles.append(metrics.counter_value('UncachedCompile') or 0)
    return losses, compiles
"""
K, MORE = 3, 5


def test_a_training_run_resumed_in_a_fresh_process_goes_on_unchanged(dev, tmp_path):
    run = {}
    exec(TRAIN, run)
    model, opt, sched = run["build"](seed=0)
    for _ in range(K):
        run["step"](model, opt, sched)
    state = run["state"](model, opt, sched)
    path = str(tmp_path / "ckpt.pt")
    serialization.save(state, path)
    lm.save(state, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert lm.is_lazy_tensor(state["optimizer"]["state"][0]["exp_avg"])  # Adam's state was on the device
    torch.testing.assert_close(serialization.load(path), whole, rtol=0, atol=0)  # the two ways save the same
    want = [run["step"](model, opt, sched) for _ in range(MORE)]

    code = TRAIN + (
        "import json, sys\n"
        "from ratex.lazy_tensor_core.utils import serialization\n"
        f"losses, compiles = resume({path!r}, serialization.load, {MORE})\n"
        "print(json.dumps({'losses': losses, 'compiles': compiles}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["losses"] == want, (got["losses"], want)
    compiles = got["compiles"]
    assert compiles[0] > 0 and compiles[1:] == [compiles[0]] * (MORE - 1), f"compiled after the first step: {compiles}"


def test_torch_save_of_lazy_tensors_loads_with_weights_only(dev, tmp_path):
    x = torch.arange(4.0).to(dev) * 3
    torch.save({"x": x}, tmp_path / "x.pt")
    loaded = torch.load(tmp_path / "x.pt", weights_only=True)
    torch.testing.assert_close(loaded["x"], torch.arange(4.0) * 3, check_device=False)
