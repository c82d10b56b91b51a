"""What `import ratex` changes in the process (ratex/process.py): each change is made by default,
each has an opt-out that leaves it out and nothing else, and settings the user made win."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch._lazy

from ratex.lazy_tensor_core.debug import metrics

GLIBC = sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION") is not None

# Prints, after `import ratex`: TVM's thread variables, both pools' thread counts, whether glibc's
# thresholds went up and the page faults of a 20 MB buffer allocated again after a free (as a
# step's activations are), and whether torch._lazy's step API is ratex's.
_PROBE = """
import ctypes, json, os, resource, sys
import torch, torch._lazy
import ratex
from ratex import process
faults = None
if {glibc}:
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    for _ in range(2):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        p = libc.malloc(20 << 20)
        libc.memset(p, 1, 20 << 20)
        libc.free(p)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({{
    "spin": os.environ.get("TVM_THREAD_POOL_SPIN_COUNT"), "bind": os.environ.get("TVM_BIND_THREADS"),
    "tvm_threads": os.environ.get("TVM_NUM_THREADS"), "torch_threads": torch.get_num_threads(),
    "retained": process.MEMORY_RETAINED, "faults": faults,
    "torch_lazy": torch._lazy.mark_step.__module__,
}}))
""".format(glibc=GLIBC)

# Every variable the probe's answers depend on, taken out of the environment it runs in (this
# process imported ratex, which set some of them).
_ASKED = ("TVM_THREAD_POOL_SPIN_COUNT", "TVM_BIND_THREADS", "TVM_NUM_THREADS", "RATEX_NUM_THREADS",
          "RATEX_SHARE_THREADS", "RATEX_TVM_POOL_YIELD", "RATEX_RETAIN_MEMORY", "RATEX_TORCH_LAZY_STEP")


def _run(**env):
    clean = {k: v for k, v in os.environ.items() if k not in _ASKED and not k.startswith("MALLOC_")}
    return subprocess.run([sys.executable, "-c", _PROBE], env=dict(clean, **env), capture_output=True, text=True,
                          timeout=300)


def _probe(**env) -> dict:
    proc = _run(**env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _memory_kept(got: dict):
    """True: the 20 MB (5120 pages) stayed with the process; False: glibc gave it back and it was
    faulted in again (or this is no glibc); None: neither."""
    if got["retained"] and got["faults"] < 500:
        return True
    if not got["retained"] and (got["faults"] is None or got["faults"] > 4000):
        return False
    return None


def _applied(got: dict) -> dict:
    """Each change, by its opt-out's name: True (made), False (left out), or all the probe saw (neither)."""
    states = {
        "RATEX_TVM_POOL_YIELD": {("0", "0"): True, (None, None): False}.get((got["spin"], got["bind"])),
        "RATEX_SHARE_THREADS": {str(got["torch_threads"]): True, None: False}.get(got["tvm_threads"]),
        "RATEX_RETAIN_MEMORY": _memory_kept(got),
        "RATEX_TORCH_LAZY_STEP": {"ratex.process": True, "torch._lazy": False}.get(got["torch_lazy"]),
    }
    return {name: got if state is None else state for name, state in states.items()}


OPT_OUTS = ("RATEX_TVM_POOL_YIELD", "RATEX_SHARE_THREADS", "RATEX_RETAIN_MEMORY", "RATEX_TORCH_LAZY_STEP")


def test_import_makes_every_change_by_default():
    assert _applied(_probe()) == {name: name != "RATEX_RETAIN_MEMORY" or GLIBC for name in OPT_OUTS}


@pytest.mark.parametrize("opt_out", OPT_OUTS)
def test_each_opt_out_leaves_its_change_out_and_only_it(opt_out):
    got = _applied(_probe(**{opt_out: "false"}))
    assert got == {name: name != opt_out and (name != "RATEX_RETAIN_MEMORY" or GLIBC) for name in OPT_OUTS}


def test_settings_you_make_yourself_win():
    got = _probe(TVM_THREAD_POOL_SPIN_COUNT="5000", TVM_BIND_THREADS="1", TVM_NUM_THREADS="3",
                 MALLOC_TRIM_THRESHOLD_="131072")
    assert (got["spin"], got["bind"], got["tvm_threads"], got["retained"]) == ("5000", "1", "3", False)


def test_one_thread_budget_for_tvm_and_torch():
    got = _probe(RATEX_NUM_THREADS="1")
    assert (got["torch_threads"], got["tvm_threads"]) == (1, "1")
    got = _probe(RATEX_NUM_THREADS="1", RATEX_SHARE_THREADS="false")  # torch's count alone
    assert (got["torch_threads"], got["tvm_threads"]) == (1, None)


@pytest.mark.parametrize("var,value", [("RATEX_NUM_THREADS", "many"), ("RATEX_RETAIN_MEMORY", "sometimes"),
                                       ("TVM_NUM_THREADS", "lots")])
def test_bad_values_fail_at_import_naming_the_variable(var, value):
    proc = _run(**{var: value})
    assert proc.returncode != 0 and f"{var}={value!r} is not valid" in proc.stderr, proc.stderr[-2000:]


def test_torch_lazy_step_api_drives_ratex(dev):
    y = torch.ones(2, device=dev) * 3
    torch._lazy.mark_step()
    torch._lazy.wait_device_ops()
    assert metrics.counter_value("MarkStep") == 1
    torch.testing.assert_close(y.cpu(), torch.full((2,), 3.0))


class _Cycle:
    def __init__(self):
        self.me = self


def test_heap_settles_once_after_warm_up(dev, monkeypatch):
    """The first step that compiles nothing after steps that did collects the cyclic garbage
    and freezes the rest; later steady steps do neither; a new program makes the next steady
    step settle again; RATEX_GC_FREEZE=false never freezes."""
    import gc
    import weakref

    import ratex.lazy_tensor_core.core.lazy_model as lm
    from ratex import config, process

    monkeypatch.setattr(process, "_heap", {"grew": False, "now": False, "full_at": None, "full_cost": 0.0})
    freezes = []
    real_freeze = gc.freeze
    monkeypatch.setattr(gc, "freeze", lambda: (freezes.append(1), real_freeze()))
    monkeypatch.setattr(config, "GC_FREEZE", True)
    from ratex.core import sync
    sync.reset_cache()  # the steps below compile, whatever ran before in this process

    torch.manual_seed(0)
    model = torch.nn.Linear(7, 3).to(dev)

    def step(rows):
        model.zero_grad(set_to_none=True)
        model(torch.randn(rows, 7).to(dev)).sum().backward()
        lm.mark_step()

    step(5)  # compiles
    assert freezes == []
    garbage = _Cycle()
    gone = weakref.ref(garbage)
    del garbage
    step(5)  # the first steady step
    assert freezes == [1] and gone() is None and gc.get_freeze_count() > 0
    step(5)
    step(5)
    assert freezes == [1]
    step(6)  # a new shape: a new program
    step(6)
    assert freezes == [1, 1]
    monkeypatch.setattr(config, "GC_FREEZE", False)
    step(4)
    step(4)
    assert freezes == [1, 1]
