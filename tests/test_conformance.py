"""No regressions against tests/conformance_expectations.json on a fixed subset of OpInfo entries.

scripts/conformance.py checks every float32 OpInfo entry (forward, and backward
where autograd applies) in worker subprocesses and writes the expectations
file with `--write`. This test reruns a small subset across op families
in-process, with the same samples, and fails when an entry the file records as
`pass` now falls back to CPU or fails, or a `fallback` entry now fails.
Improvements never fail it: rerun the script with --write to record them.
"""
import importlib.util
import json
import os

import pytest

from ratex import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("ratex_conformance", os.path.join(ROOT, "scripts", "conformance.py"))
conformance = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conformance)

with open(conformance.EXPECTATIONS) as _f:
    EXPECTED = json.load(_f)

MAX_SAMPLES = conformance.DEFAULT_MAX_SAMPLES  # the same samples as the script (same seed)

# (entry, phase): a spread over families, all `pass` or `fallback` when the file was written.
SUBSET = [
    # pointwise unary / binary / ternary
    ("abs", "forward"), ("exp", "backward"), ("sigmoid", "backward"), ("nn.functional.gelu", "forward"),
    ("add", "backward"), ("div.no_rounding_mode", "forward"), ("pow", "forward"), ("maximum", "forward"),
    ("where", "forward"), ("clamp", "forward"), ("addcmul", "forward"), ("lerp", "forward"),
    # reductions, scans, sorting
    ("sum", "backward"), ("mean", "forward"), ("amax", "forward"), ("argmax", "forward"),
    ("var", "forward"), ("cumsum", "forward"), ("sort", "forward"), ("logsumexp", "forward"),
    # linear algebra
    ("mm", "backward"), ("bmm", "forward"), ("addmm", "forward"), ("einsum", "forward"),
    ("nn.functional.linear", "backward"),
    # shapes, views, indexing
    ("reshape", "forward"), ("permute", "backward"), ("transpose", "forward"), ("cat", "backward"),
    ("stack", "forward"), ("squeeze", "forward"), ("index_select", "forward"), ("gather", "forward"),
    ("masked_fill", "forward"), ("tril", "forward"), ("topk", "forward"), ("nn.functional.pad.constant", "forward"),
    # neural-network layers and losses
    ("nn.functional.conv2d", "forward"), ("nn.functional.relu", "backward"), ("softmax", "backward"),
    ("log_softmax", "forward"), ("nn.functional.layer_norm", "forward"), ("nn.functional.embedding", "forward"),
    ("nn.functional.mse_loss", "backward"), ("nn.functional.nll_loss", "forward"),
    ("nn.functional.avg_pool2d", "forward"), ("nn.functional.batch_norm", "backward"),
    ("nn.functional.cross_entropy", "forward"), ("nn.functional.avg_pool3d", "forward"),
    # corners the conformance run found: index_put with full slices, strided views, norms, decompositions
    ("__getitem__", "backward"), ("as_strided", "forward"), ("linalg.vector_norm", "backward"), ("xlogy", "forward"),
]

_ENTRIES = conformance.entries({name for name, _ in SUBSET})
_ALLOWED = {"pass": {"pass"}, "fallback": {"pass", "fallback"}}
# The file is recorded on the CPU target. On another, an entry may fall back where the CPU has a
# kernel of its own (host loops: scans, scatter reductions), but never fail.
_ALLOWED_HERE = _ALLOWED if config.DEVICE == "CPU" else {k: {"pass", "fallback"} for k in _ALLOWED}


def test_subset_is_recorded():
    """Every chosen entry exists and is recorded as pass or fallback (keep SUBSET in step with the file)."""
    missing = [(n, p) for n, p in SUBSET if n not in _ENTRIES or EXPECTED[p].get(n) not in _ALLOWED]
    assert not missing, missing


@pytest.mark.parametrize("name,phase", SUBSET, ids=[f"{p}-{n}" for n, p in SUBSET])
def test_no_regression(dev, name, phase):
    expected = EXPECTED[phase].get(name)
    if name not in _ENTRIES or expected not in _ALLOWED:
        pytest.skip(f"{phase} {name} is recorded as {expected!r}")
    got = conformance.check_entry(_ENTRIES[name], phase, max_samples=MAX_SAMPLES, device=dev)
    detail = got.get("error") or ", ".join(got.get("fallbacks", []))
    assert got["samples"] > 0, f"no sample of {name} could be checked: {got}"
    assert got["status"] in _ALLOWED_HERE[expected], f"{phase} {name}: was {expected}, now {got['status']}: {detail}"
