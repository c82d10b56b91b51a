"""The bfloat16, float16 and NaN/infinity op sweeps hold their recorded results on a fixed subset, both ways.

`scripts/conformance.py --dtype bfloat16` (and float16) checks every OpInfo entry CPU PyTorch runs
in that dtype against CPU's result in it, and `--nonfinite` every float32 entry with NaN, +inf and
-inf put into its sample tensors; `--write` records each entry's status in
tests/conformance_ops_<dtype>[_nonfinite].json. This test reruns a subset in-process with the same
samples and seeds and asserts the recorded status: a pass that now falls back or fails fails it,
and so does a recorded failure or fallback that now passes (rerun the script with --write so that
the file says what ratex does).
"""
import importlib.util
import json
import os

import pytest

# torch.testing._internal (OpInfo, module_db, optim_db) imports expecttest, a test extra
pytest.importorskip("expecttest", reason="pip install expecttest (pyproject's test extra)")

from ratex import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("ratex_conformance", os.path.join(ROOT, "scripts", "conformance.py"))
conformance = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conformance)

# sweep -> (entry, phase): the NaN-sensitive families (max/min reductions and their inf norms,
# maximum/minimum and clamps, sort/topk/median) and a spread of others, pass, fallback and fail alike.
SUBSETS = {
    "ops-nonfinite": [
        ("amax", "forward"), ("amin", "backward"), ("max.reduction_no_dim", "forward"),
        ("max.reduction_with_dim", "forward"), ("maximum", "forward"), ("minimum", "backward"),
        ("clamp", "forward"), ("nn.functional.hardtanh", "forward"), ("sort", "forward"), ("topk", "forward"),
        ("median", "forward"), ("linalg.vector_norm", "forward"), ("softmax", "forward"), ("cumsum", "forward"),
        ("nn.functional.max_pool2d", "forward"), ("kthvalue", "forward"),
    ],
    "ops-bfloat16": [
        ("sort", "forward"), ("topk", "forward"), ("sum", "forward"), ("amax", "backward"), ("softmax", "forward"),
        ("maximum", "forward"), ("mm", "forward"), ("nn.functional.layer_norm", "forward"), ("kthvalue", "forward"),
        ("div.floor_rounding", "forward"), ("nn.functional.batch_norm", "backward"),
    ],
    "ops-float16": [
        ("sort", "forward"), ("topk", "forward"), ("add", "forward"), ("mean", "forward"), ("exp", "forward"),
        ("div.trunc_rounding", "forward"),
    ],
}

EXPECTED = {}
for _name in SUBSETS:
    with open(conformance.SWEEPS[_name].expectations) as _f:
        EXPECTED[_name] = json.load(_f)
CASES = [(sweep, key, phase) for sweep, subset in SUBSETS.items() for key, phase in subset]


def test_subset_is_recorded():
    """Every chosen entry exists in its sweep and is recorded in its file (not as skipped)."""
    missing = [c for c in CASES if EXPECTED[c[0]].get(c[2], {}).get(c[1]) in (None, "skip")
               or c[1] not in conformance.SWEEPS[c[0]].entries({c[1]})]
    assert not missing, missing


def _flags(sweep):
    """The script's options that select `sweep` ("ops-bfloat16", "ops-nonfinite", ...)."""
    parts = sweep.split("-")[1:]
    return "".join(" --nonfinite" if p == "nonfinite" else f" --dtype {p}" for p in parts)


@pytest.mark.parametrize("sweep,key,phase", CASES, ids=[f"{s}-{p}-{k}" for s, k, p in CASES])
def test_recorded_result_holds(dev, sweep, key, phase):
    s = conformance.SWEEPS[sweep]
    want = EXPECTED[sweep][phase][key]
    got = s.check(s.entries({key})[key], phase, device=dev)
    detail = got.get("error") or ", ".join(got.get("fallbacks", []))
    hint = f"{sweep} {phase} {key}: recorded {want}, now {got['status']} ({detail}); if this is a fix, rerun " \
           f"scripts/conformance.py --ops {key}{_flags(sweep)} --write"
    if config.DEVICE != "CPU" and want == "pass" and got["status"] == "fallback":
        pytest.skip("recorded on the CPU target; another may fall back where the CPU has a host loop")
    assert got["status"] == want, hint
