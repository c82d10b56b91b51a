"""Profiling table, Chrome trace, RATEX_PROFILE, RATEX_SAVE_IR, graph_text/graph_dot, step closures."""
import json
import os
import subprocess
import sys

import pytest
import torch

import ratex
from ratex import config
from ratex.core import sync
from ratex.lazy_tensor_core.core import lazy_model as lm
from ratex.lazy_tensor_core.debug import metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def fresh(dev, monkeypatch):
    """The lazy device with an empty memory cache and no disk cache."""
    monkeypatch.setattr(config, "CACHE_DIR", None)
    sync.reset_cache()
    return dev


def _step(dev, w, scale=3.0):
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(dev)
    return ((x @ w) * scale + 1).relu().sum(dim=0)


def test_table_rows_compile_then_hit(fresh):
    w = torch.ones(4, 2).to(fresh)
    with ratex.profiler.Profiler() as prof:
        for _ in range(2):
            with prof.region("forward"):
                y = _step(fresh, w)
            lm.mark_step()
            prof.step()
    assert len(prof.rows) == 2
    first, second = prof.rows
    assert first["cache"] == {"miss": 1}
    assert first["compile"] > 0 and first["lower"] > 0 and first["execute"] > 0
    assert second["cache"] == {"hit": 1}
    assert second["compile"] == 0 and second["lower"] == 0
    assert second["execute"] > 0
    for row in prof.rows:
        assert row["regions"]["forward"] > 0
        assert row["total"] >= row["trace"]
        assert abs(row["total"] - row["trace"] - sum(row[k] for k in ("lower", "compile", "disk", "execute", "other"))) < 1e-6
    text = prof.table()
    lines = text.splitlines()
    assert lines[0].split() == ["step", "forward", "trace", "lower", "compile", "disk", "execute", "other", "total", "cache"]
    assert len(lines) == 4 and lines[2].split()[-1] == "miss" and lines[3].split()[-1] == "hit"
    assert str(prof) == text
    assert torch.allclose(y.cpu(), _step("cpu", torch.ones(4, 2)))


def test_sync_inside_step_counts_as_sync(fresh):
    """.item() inside a step is a sync: its time is not counted as trace."""
    w = torch.ones(4, 2).to(fresh)
    with ratex.profiler.Profiler() as prof:
        _step(fresh, w, 5.0).sum().item()
        prof.step()
    (row,) = prof.rows
    assert row["syncs"] == 1 and row["cache"] == {"miss": 1}
    assert row["trace"] < row["total"] - row["compile"]


def test_chrome_trace(fresh, tmp_path):
    w = torch.ones(4, 2).to(fresh)
    with ratex.profiler.Profiler() as prof:
        for _ in range(2):
            with prof.region("forward"):
                y = _step(fresh, w)  # noqa: F841  (a live tensor: mark_step computes it)
            lm.mark_step()
            prof.step()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["name"] for e in events}
    assert {"forward", "lower", "compile", "execute", "mark_step", "sync", "step 0", "step 1"} <= names
    for e in events:
        assert e["ts"] >= 0 and e["dur"] >= 0 and "pid" in e and "tid" in e
    step0 = next(e for e in events if e["name"] == "step 0")
    compile_ev = next(e for e in events if e["name"] == "compile")
    assert step0["ts"] <= compile_ev["ts"] and compile_ev["ts"] + compile_ev["dur"] <= step0["ts"] + step0["dur"] + 1
    assert step0["args"]["cache"] == "miss"


def test_save_ir(fresh, tmp_path, monkeypatch):
    path = tmp_path / "ir.txt"
    monkeypatch.setattr(config, "SAVE_IR", str(path))
    w = torch.ones(4, 2).to(fresh)
    for _ in range(2):
        y = _step(fresh, w, 7.0)  # noqa: F841
        lm.mark_step()
    text = path.read_text()
    assert text.count("==== graph ") == 1  # the second step was a cache hit: nothing appended
    assert "aten.mm.default(%" in text and "-> (3, 2) float32" in text
    assert "@I.ir_module" in text and "R.function" in text and "R.nn.relu" in text
    created = text.split("-- created by")[1].split("-- lazy IR")[0]
    assert "test_profiler.py" in created and "in _step" in created  # the user code that made the roots


def test_graph_text_runs_nothing(dev):
    w = torch.ones(4, 2).to(dev)
    y = _step(dev, w, 9.0)
    metrics.reset()
    text = ratex.debug.graph_text([y])
    dot = ratex.debug.graph_dot(y)
    for name in ("MarkStep", "UncachedCompile", "CachedCompile", "PersistentCacheHit"):
        assert metrics.counter_value(name) is None
    assert metrics.metric_data("ExecuteTime") is None and metrics.metric_data("CompileTime") is None
    node, idx = y._value()
    assert node.results[idx] is None  # still pending
    lines = text.splitlines()
    assert lines[0].endswith("= input  -> (3, 4) float32") or lines[1].endswith("= input  -> (3, 4) float32")
    assert any(" = aten.mm.default(%" in line and line.endswith("-> (3, 2) float32") for line in lines)
    assert any("aten.relu.default" in line for line in lines)
    assert lines[-1].startswith("return %")
    assert dot.startswith("digraph") and "aten.mm.default" in dot and "->" in dot
    assert torch.allclose(y.cpu(), _step("cpu", torch.ones(4, 2), 9.0))


def test_graph_text_rejects_cpu_tensors():
    with pytest.raises(TypeError, match="lazy"):
        ratex.debug.graph_text([torch.ones(2)])


def test_step_closure_runs_after_execution(dev):
    w = torch.ones(4, 2).to(dev)
    y = _step(dev, w)
    seen = []

    def closure(t, tag):
        node, idx = t._value()
        seen.append((tag, node.results[idx] is not None, t.cpu().tolist()))

    lm.add_step_closure(closure, args=(y, "a"))
    assert seen == []
    lm.mark_step()
    assert seen == [("a", True, _step("cpu", torch.ones(4, 2)).tolist())]
    lm.mark_step()
    assert len(seen) == 1  # runs once


def test_ratex_profile_env_prints_rows(tmp_path):
    script = (
        "import torch, ratex\n"
        "import ratex.lazy_tensor_core.core.lazy_model as lm\n"
        "d = lm.lazy_device()\n"
        "w = torch.ones(4, 2).to(d)\n"
        "for _ in range(3):\n"
        "    y = (torch.ones(3, 4).to(d) @ w).relu()\n"
        "    lm.mark_step()\n"
    )
    env = dict(os.environ, RATEX_PROFILE="1", RATEX_CACHE_DIR="")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    header = [i for i, line in enumerate(lines) if line.split()[:2] == ["step", "trace"]]
    assert len(header) == 1  # the header only the first time
    rows = [line.split() for line in lines[header[0] + 2 :]][:3]
    assert [r[0] for r in rows] == ["0", "1", "2"]
    assert [r[-1] for r in rows] == ["miss", "hit", "hit"]
