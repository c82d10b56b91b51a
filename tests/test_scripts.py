"""The benchmark scripts' plumbing: a cell runs in a fresh process and reports a result.

Timings are the scripts' business, not the tests'; these only check that the
commands docs/benchmarks.md gives still run, and that scripts/tune.py calls bench's
cell runner with the arguments it takes.
"""
import argparse
import os
import re
import subprocess
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
sys.path.insert(0, SCRIPTS)

import bench  # noqa: E402
import tune  # noqa: E402


def test_bench_runs_a_cell_and_prints_its_table():
    out = subprocess.run(
        [sys.executable, os.path.join(SCRIPTS, "bench.py"), "--models", "lenet-b1", "--systems", "eager,ratex_lazy",
         "--steps", "4", "--warmup", "1"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("lenet-b1")]
    assert [row[1] for row in rows[:2]] == ["eager", "ratex_lazy"], out.stdout
    assert all(float(row[2]) > 0 for row in rows[:2]), out.stdout


def test_step_phases_prints_each_modes_phases():
    out = subprocess.run(
        [sys.executable, os.path.join(SCRIPTS, "step_phases.py"), "lenet-b1", "--modes", "eager,script,compile",
         "--steps", "3", "--warmup", "2"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    modes = (["eager"], ["script"], ["compile"])
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line.split()[:1] in modes}
    assert set(rows) == {"eager", "script", "compile"}, out.stdout
    for row in rows.values():  # seven phases, their total, wall ms: none negative, the total above zero
        assert len(row) >= 10 and all(float(v) >= 0 for v in row[1:10]) and float(row[8]) > 0, out.stdout
    split = [line for line in out.stdout.splitlines() if line.startswith("compile: median step")]
    assert len(split) == 1 and "programs" in split[0] and "of eager's step" in split[0], out.stdout
    host = [line for line in out.stdout.splitlines() if "its host time, timed apart" in line]
    assert len(host) == 1 and len(re.findall(r" \d+(?:,|$)", host[0])) == 3, out.stdout
    bad = subprocess.run([sys.executable, os.path.join(SCRIPTS, "step_phases.py"), "lenet-b1", "--modes", "jit"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "unknown mode(s) jit" in bad.stderr


def test_tune_times_a_configuration_through_bench():
    args = argparse.Namespace(timeout=300, verbose=True, threads=1)
    result = tune._cell("lenet-b1", "eager", args, tune._env(args), steps=4, warmup=1)
    assert result["model"] == "lenet-b1" and result["system"] == "eager" and "error" not in result
    assert result["median_ms"] > 0


@pytest.mark.parametrize("argv,says", [(["--steps", "2"], "--steps must be at least"),
                                       (["--models", "resnet"], "unknown model/system: resnet"),
                                       (["--nproc", "2", "--models", "resnet"], "unknown model: resnet")])
def test_bench_refuses_bad_arguments(argv, says):
    out = subprocess.run([sys.executable, os.path.join(SCRIPTS, "bench.py"), *argv], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and says in out.stderr, out
    assert "resnet" not in bench.MODELS


def test_loader_bench_prints_both_ways():
    out = subprocess.run([sys.executable, os.path.join(SCRIPTS, "loader_bench.py"), "--model", "lenet-b1",
                          "--steps", "3", "--rounds", "1"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:1] in (["to"], ["loader"])]
    assert [row[0] for row in rows] == ["to", "loader"] and all(float(row[1]) > 0 for row in rows), out.stdout


def test_zoo_trains_one_model_like_cpu():
    """scripts/zoo.py's row for one model and mode: a tiny GPT-2 trained 3 steps on the lazy device
    against CPU (its --one form, which the table's subprocesses run)."""
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, os.path.join(SCRIPTS, "zoo.py"), "--one", "gpt2", "lazy"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["status"] == "pass" and row["fallbacks"] == [] and len(row["losses"]) == 3, row
    bad = subprocess.run([sys.executable, os.path.join(SCRIPTS, "zoo.py"), "--one", "gpt5", "lazy"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "gpt5" in bad.stderr


def test_kernel_check_compares_each_kernel_with_its_unscheduled_self(tmp_path, monkeypatch):
    """scripts/kernel_check.py: every kernel of a scripted step agrees with its rule's loops on
    the CPU; an output that a compiled kernel got wrong (here: negated) is reported, its TIR saved."""
    import kernel_check  # noqa: PLC0415
    from ratex import config  # noqa: PLC0415

    monkeypatch.setattr(config, "NATIVE_RUNNER", False)  # as the script sets them: programs run through Program.run
    monkeypatch.setattr(config, "ASYNC", False)
    programs = kernel_check.run_step("stack", "script", -1)
    assert len(programs) == 1
    checked, bad, _ = kernel_check.check(*programs[0], str(tmp_path))
    assert checked >= 5 and bad == []
    calls = kernel_check.kernel_calls

    def one_wrong(program, inputs):
        got, outs = calls(program, inputs)
        name, before, after = got[-1]
        return got[:-1] + [(name, before, after[:-1] + [-after[-1] - 1])], outs

    monkeypatch.setattr(kernel_check, "kernel_calls", one_wrong)
    _, bad, _ = kernel_check.check(*programs[0], str(tmp_path))
    assert len(bad) == 1 and bad[0][2] >= 1
    saved = os.listdir(tmp_path)
    assert len(saved) == 1 and "# scheduled" in (tmp_path / saved[0]).read_text()
