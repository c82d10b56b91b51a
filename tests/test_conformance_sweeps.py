"""The module and optimizer sweeps hold their recorded results on a fixed subset, both ways.

`scripts/conformance.py --modules` checks every float32 entry of PyTorch's module_db (forward,
input and parameter gradients, buffers, one SGD step) and `--optims` every optim_db config
(5 steps, for-loop and foreach) against CPU, and `--write` records each result in
tests/conformance_modules.json / tests/conformance_optims.json: the status, a fallback's `aten::`
counters, a failure's stage and message. This test reruns a subset in-process with the same
samples and seeds and asserts the same status, the same fallback counters and, for a failure,
the same stage. An entry recorded as failing that now passes fails the test too: rerun the
script with --write so that the file says what ratex does.
"""
import importlib.util
import json
import os

import pytest

# torch.testing._internal (OpInfo, module_db, optim_db) imports expecttest, a test extra
pytest.importorskip("expecttest", reason="pip install expecttest (pyproject's test extra)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("ratex_conformance", os.path.join(ROOT, "scripts", "conformance.py"))
conformance = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conformance)

# (entry, phase): quick entries across families, recorded pass, fallback and fail alike.
MODULES = [
    ("nn.Linear", "train"), ("nn.Conv2d", "train"), ("nn.BatchNorm2d", "train"), ("nn.BatchNorm2d", "eval"),
    ("nn.Embedding", "train"), ("nn.GELU", "train"), ("nn.Softmax", "train"), ("nn.LogSoftmax", "train"),
    ("nn.Hardshrink", "train"), ("nn.Softshrink", "train"), ("nn.CELU", "train"), ("nn.MultiheadAttention", "train"),
    ("nn.LazyConv1d", "train"), ("nn.BCELoss", "train"), ("nn.HuberLoss", "train"), ("nn.Bilinear", "train"),
    ("nn.FractionalMaxPool2d", "train"), ("nn.ConvTranspose2d", "train"), ("nn.Conv3d", "train"),
    ("nn.MaxPool3d", "train"), ("nn.ReplicationPad2d", "train"), ("nn.MultiMarginLoss", "train"),
    ("nn.CTCLoss", "train"),
]
# LBFGS: its line search (float reads compared with tensors, a step size that is a tensor) and a
# Tensor lr read into Python, each checked in float64 and in float32 (see ROUNDING_AMPLIFIERS).
OPTIMS = [
    ("Adam/default", "foreach"), ("AdamW/amsgrad", "forloop"), ("SGD/nesterov", "foreach"),
    ("Adagrad/Tensor lr", "forloop"), ("Adafactor/default", "forloop"), ("SparseAdam/default", "forloop"),
    ("LBFGS/strong_wolfe", "forloop"), ("LBFGS/Tensor lr", "forloop"),
]

SWEEPS = {"modules": MODULES, "optims": OPTIMS}
EXPECTED = {}
for _name in SWEEPS:
    with open(conformance.SWEEPS[_name].expectations) as _f:
        EXPECTED[_name] = json.load(_f)
CASES = [(sweep, key, phase) for sweep, subset in SWEEPS.items() for key, phase in subset]


def test_subset_is_recorded():
    """Every chosen entry exists in the database and in its expectations file."""
    missing = [c for c in CASES if c[1] not in EXPECTED[c[0]].get(c[2], {})]
    assert not missing, missing


@pytest.mark.parametrize("sweep,key,phase", CASES, ids=[f"{s}-{p}-{k}" for s, k, p in CASES])
def test_recorded_result_holds(dev, sweep, key, phase):
    s = conformance.SWEEPS[sweep]
    want = EXPECTED[sweep][phase][key]
    got = s.check(s.entries({key})[key], phase, device=dev)
    said = conformance.expectation(got)
    hint = f"{phase} {key}: recorded {want}, now {said}; if this is a fix, rerun scripts/conformance.py --{sweep} --write"
    assert said["status"] == want["status"], hint
    assert said.get("fallbacks") == want.get("fallbacks"), hint
    assert said.get("stage") == want.get("stage"), hint


def test_rounding_amplifier_comparison_can_fail():
    """An optimizer that amplifies rounding (LBFGS) is compared in float64 to 1e-9 and in float32
    within SPREAD_FACTOR times CPU float32's own spread: a float64 run one part in a million off
    fails, and so does a float32 run further from CPU than the spread allows; one within passes."""
    import torch

    g = torch.Generator().manual_seed(0)
    cpu64 = ([torch.tensor(1.25, dtype=torch.float64), torch.tensor(0.5, dtype=torch.float64)],
             [torch.randn(4, 3, generator=g, dtype=torch.float64), torch.randn(3, generator=g, dtype=torch.float64)])
    cpu32 = ([x.float() + 1e-3 for x in cpu64[0]], [x.float() + 1e-3 for x in cpu64[1]])  # spread 1e-3
    nudged = ([x + 1e-4 for x in cpu32[0]], [x + 1e-4 for x in cpu32[1]])

    def compare(lazy64=cpu64, lazy32=cpu32):
        return conformance.compare_optim_runs({torch.float64: (lazy64, cpu64), torch.float32: (lazy32, cpu32)},
                                              nudged)

    def shifted(run, by, stage):
        losses, params = run
        return ([x + by for x in losses], params) if stage == "loss" else (losses, [x + by for x in params])

    same = compare()
    assert "status" not in same, same
    assert same["float32_spread"] == {"loss": 1e-3, "params": 1e-3}
    off64 = compare(lazy64=(cpu64[0], [x * (1 + 1e-6) for x in cpu64[1]]))
    assert (off64["status"], off64["stage"]) == ("fail", "params") and off64["error"].startswith("float64: ")
    assert "status" not in compare(lazy32=shifted(cpu32, 1.5e-3, "params"))
    beyond = compare(lazy32=shifted(cpu32, 3e-3, "params"))
    assert (beyond["status"], beyond["stage"]) == ("fail", "params") and beyond["error"].startswith("float32")
    loss = compare(lazy32=shifted(cpu32, 3e-3, "loss"))
    assert (loss["status"], loss["stage"], loss["first_bad_step"]) == ("fail", "loss", 0)
    # Every other optimizer: float32 alone, at RTOL/ATOL.
    plain = conformance.compare_optim_runs({torch.float32: (shifted(cpu32, 1e-3, "params"), cpu32)})
    assert (plain["status"], plain["stage"]) == ("fail", "params") and "distance" not in plain
