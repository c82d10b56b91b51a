"""Settings (ratex/config.py) and targets (tvm_lowering/targets.py): one parsing rule, settings
reaching the compile as arguments, one registration per target in each layer."""
import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

import tvm_lowering
from ratex import config
from ratex.core import device, executor
from tvm_lowering import Options, pipeline, resolve_target, targets
from tvm_lowering.library_dispatch import AUTO_MIN_MACS

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Runs a step with the settings of its environment; prints what they turned into.
_PROBE = """
import json, torch, ratex
import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex import config
from ratex.core import executor, kernels, launch
from ratex.core.device import backend
from tvm_lowering import pipeline
y = torch.ones(3).to("lazy") * 2
lm.mark_step()
in_flight = len(launch._in_flight)  # a launched program not yet collected: it runs on a worker
passes = [p.info.name for p in pipeline._passes(backend().target, executor.compile_options())]
print(json.dumps({
    "schedule": config.CPU_SCHEDULE, "schedule pass": "ApplyDefaultSchedule" in passes,
    "async": config.ASYNC, "in flight": in_flight, "native kernels": kernels.NATIVE is not None,
    "result": y.cpu().tolist(),
}))
"""


def _run(**env):
    env = dict(os.environ, **{"RATEX_DEVICE": "CPU", **env})  # settings are parsed alike on every target
    return subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_false_turns_a_default_on_setting_off():
    """RATEX_CPU_SCHEDULE=false takes ratex's schedules out of the pipeline, RATEX_ASYNC=off runs
    programs inline, RATEX_NATIVE_KERNELS=no keeps the Python kernels: every boolean reads
    1/true/yes/on and 0/false/no/off."""
    proc = _run(RATEX_CPU_SCHEDULE="false", RATEX_ASYNC="off", RATEX_NATIVE_KERNELS="no")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"schedule": False, "schedule pass": False, "async": False, "in flight": 0,
                   "native kernels": False, "result": [2.0, 2.0, 2.0]}


def test_a_value_that_is_no_boolean_fails_at_import():
    proc = _run(RATEX_ASYNC="maybe")
    assert proc.returncode != 0
    assert "RATEX_ASYNC='maybe' is not valid; use true or false" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("raw,value", [("1", True), ("TRUE", True), (" yes ", True), ("on", True), ("0", False),
                                       ("False", False), ("no", False), ("OFF", False), ("", False)])
def test_the_boolean_rule(monkeypatch, raw, value):
    monkeypatch.setenv("RATEX_SOME_FLAG", raw)
    assert config._flag("RATEX_SOME_FLAG", not value) is value


def test_cuda_graphs_on_cpu_fail_at_import():
    proc = _run(RATEX_CUDA_GRAPH="1")
    assert proc.returncode != 0
    assert "RATEX_CUDA_GRAPH='1': CUDA graphs are for RATEX_DEVICE=GPU, but RATEX_DEVICE=CPU" in proc.stderr, \
        proc.stderr[-2000:]


@pytest.mark.cpu_only("the CPU target's options")
def test_settings_reach_the_compile_as_options(monkeypatch):
    """RATEX_KERNELS and RATEX_CPU_SCHEDULE, read at each compile, become the target's Options."""
    cpu = resolve_target("CPU")
    monkeypatch.setattr(config, "KERNELS", "AUTO")
    monkeypatch.setattr(config, "CPU_SCHEDULE", True)
    assert executor.compile_options() == Options(library=True, library_min_macs=AUTO_MIN_MACS, schedule=True)
    monkeypatch.setattr(config, "KERNELS", "LIBRARY")
    monkeypatch.setattr(config, "CPU_SCHEDULE", False)
    options = executor.compile_options()
    assert options == Options(library=True, library_min_macs=0, schedule=False)
    assert "ApplyDefaultSchedule" not in [p.info.name for p in pipeline._passes(cpu, options)]
    monkeypatch.setattr(config, "KERNELS", "TVM")
    assert not executor.compile_options().library


def test_each_target_brings_its_policy():
    cpu, gpu = resolve_target("CPU"), resolve_target("GPU", "sm_80")
    assert cpu.tunable and cpu.host_kernels and cpu.schedule is not None and str(cpu.device()) == "cpu:0"
    assert not gpu.tunable and not gpu.host_kernels and gpu.schedule is None and str(gpu.device()) == "cuda:0"
    assert "sm_80" in gpu.key
    assert cpu.options("auto").library_min_macs == AUTO_MIN_MACS and gpu.options("auto").library_min_macs == 0
    assert not gpu.options("library", library_runs=False).library  # a torch without CUDA has no kernels to call
    # the CUDA pipeline's own (dlight's GPU rules), and not ratex's CPU schedules beside it
    assert [p.info.name for p in pipeline._passes(gpu, Options())].count("ApplyDefaultSchedule") == 1
    assert gpu.options(cuda_graph=True).cuda_graph and not cpu.options(cuda_graph=True).cuda_graph
    with pytest.raises(ValueError, match="kernels='fast' is not valid; use one of: auto, library, tvm"):
        cpu.options("fast")
    with pytest.raises(ValueError, match="unknown target 'TPU'; valid values: CPU, GPU"):
        resolve_target("TPU")


def test_every_target_has_a_backend_and_ratex_device_names_them():
    assert tuple(device.BACKENDS) == targets.names() == ("CPU", "GPU")
    assert all(cls.name == name for name, cls in device.BACKENDS.items())
    assert config.DEVICE in targets.names()


def _reads_settings(tree) -> list:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv"):
            found.append(f"os.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ratex":
            found.append(f"from {node.module} import")
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "ratex" for a in node.names):
            found.append("import ratex")
    return found


def test_tvm_lowering_reads_neither_the_environment_nor_ratex():
    package = pathlib.Path(tvm_lowering.__file__).parent
    readers = {}
    for path in sorted(package.rglob("*.py")):
        found = _reads_settings(ast.parse(path.read_text()))
        if found:
            readers[str(path.relative_to(package))] = found
    assert readers == {}
