"""Out-of-range indices raise IndexError at the sync point that reads results, as PyTorch raises
at the op: on the plain lazy path and under ratex.jit.script, for every op that indexes with a
tensor (forward and backward), with the failed step rolled back and no extra compile.

Every op reads an index tensor of its own, so one program per front end serves every case:
an in-range run is compared with CPU, then each op gets a bad index in turn. Large overruns
(which once read or wrote far out of bounds: garbage or a segfault) run in a subprocess, so a
crash fails the test instead of killing pytest; it also reloads its programs from the disk
cache, whose programs must report as fresh ones do.
"""
import json
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ratex
import ratex.lazy_tensor_core.core.lazy_model as lm
import tvm_lowering
from ratex.core import graph, launch
from ratex.lazy_tensor_core.debug import metrics
from test_gpu import build_for_cuda  # noqa: F401  (a fixture)

HERE = os.path.dirname(os.path.abspath(__file__))

# name -> (in-range indices, the size they index, whether negative ones count from the end, the op named)
CASES = {
    "embedding": ([[0, 5, 2], [3, 3, 1]], 6, False, "aten.embedding.default"),
    "index_select": ([3, 0, 1], 4, False, "aten.index_select.default"),
    "gather": ([[0, 4], [1, 2], [3, 3], [4, 0]], 5, False, "aten.gather.default"),
    "scatter": ([[0, 4], [1, 2], [3, 0], [4, 1]], 5, False, "aten.scatter.value"),
    "scatter_add": ([[0, 0], [1, 2], [3, 3], [4, 1]], 5, False, "aten.scatter_add.default"),
    "index": ([3, -1, -4], 4, True, "aten.index.Tensor"),
    "index2": ([0, -1, 3], 4, True, "aten.index.Tensor"),  # x[i, i]: dim 0 (size 4) fails first
    "index_put": ([1, -1, 1], 4, True, "aten.index_put.default"),
    "take": ([0, 19, -1, -20], 20, True, "aten.take.default"),
    "put": ([0, -1, 7], 20, True, "aten.put.default"),
    "nll_loss": ([0, 4, -100, 1], 5, False, "aten.nll_loss_forward.default"),  # -100: ignore_index
    "index_add": ([0, 3, 0], 4, False, "aten.index_add.default"),
    "index_copy": ([2, 0, 3], 4, False, "aten.index_copy.default"),
}
NAMES = tuple(CASES)


def ops(x, w, b, idx, scripted=False):
    """Every checked op, each reading its own index tensor: a dict name -> output.

    `scripted`: for ratex.jit.script's forward, where TVM differentiates. There the gather,
    index_add and index_copy read the buffer b, since Relax has no gradient for gather_elements
    or scatters; and the
    log-probabilities stand in for nll_loss, which the converter lacks (the loss of a scripted
    model is computed outside it anyway)."""
    logp = F.log_softmax(x, 1)
    return {
        "embedding": F.embedding(idx["embedding"], w),
        "index_select": x.index_select(0, idx["index_select"]),
        "gather": (b if scripted else x).gather(1, idx["gather"]),
        "scatter": b.scatter(1, idx["scatter"], 2.5),
        "scatter_add": b.scatter_add(1, idx["scatter_add"], b[:, :2] * 3),
        "index": x[idx["index"]],
        "index2": x[idx["index2"], idx["index2"]],
        "index_put": b.index_put((idx["index_put"],), b[1:] * 2, accumulate=True),
        "take": x.take(idx["take"]),
        "put": b.put(idx["put"], b[0, :3] + 1, accumulate=True),
        "nll_loss": logp if scripted else F.nll_loss(logp, idx["nll_loss"]),
        "index_add": (b if scripted else x).index_add(0, idx["index_add"], b[1:] * 2, alpha=0.5),
        "index_copy": (b if scripted else x).index_copy(0, idx["index_copy"], b[:3] + 1),
    }


def indices(bad=None, value=None, device="cpu"):
    """Every op's in-range index tensor, op `bad`'s holding `value` at its first position."""
    out = {}
    for name, (good, _, _, _) in CASES.items():
        t = torch.tensor(good)
        if name == bad:
            t.view(-1)[0] = value
        out[name] = t.to(device)
    return out


def overruns(name):
    """(small overrun, refused negative) indices of op `name`, and the dimension they fail in."""
    _, size, wraps, _ = CASES[name]
    dim = {"gather": 1, "scatter": 1, "scatter_add": 1, "take": -1, "put": -1, "nll_loss": 1}.get(name, 0)
    return (size, -size - 1 if wraps else -1), dim


def _state():
    torch.manual_seed(0)
    return torch.randn(4, 5), torch.randn(6, 3), torch.randn(4, 5)


def _loss(outs):
    return sum(o.sum() for o in outs.values())


def cpu_reference(scripted=False):
    """(outputs, x's gradient, w's gradient) of the in-range step on CPU (as scripted, see `ops`)."""
    x, w, b = _state()
    x.requires_grad_(), w.requires_grad_()
    idx = indices()
    outs = ops(x, w, b, idx, scripted)
    if scripted:
        outs["nll_loss"] = F.nll_loss(outs["nll_loss"], idx["nll_loss"])
    _loss(outs).backward()
    return {k: v.detach() for k, v in outs.items()}, x.grad, w.grad


class LazyStep:
    """The step on the plain lazy path: every op, its backward, and a write to `count`."""

    def __init__(self, dev):
        x, w, b = _state()
        self.x, self.w = x.to(dev).requires_grad_(), w.to(dev).requires_grad_()
        self.b = b.to(dev)
        self.count = torch.zeros(3).to(dev)
        self.dev, self.warned = dev, []

    def __call__(self, idx):
        self.x.grad = self.w.grad = None
        outs = ops(self.x, self.w, self.b, {k: v.to(self.dev) for k, v in idx.items()})
        _loss(outs).backward()
        self.count.add_(1)
        lm.mark_step()
        return outs


class Indexer(nn.Module):
    """Every op in a forward for ratex.jit.script: x and w are parameters (their ops are
    differentiated by TVM), b a buffer (its ops only run forward)."""

    def __init__(self):
        super().__init__()
        x, w, b = _state()
        self.x, self.w = nn.Parameter(x), nn.Parameter(w)
        self.register_buffer("b", b)

    def forward(self, *idx):
        return tuple(ops(self.x, self.w, self.b, dict(zip(NAMES, idx)), scripted=True).values())


class ScriptStep:
    """The step under ratex.jit.script: the scripted forward, its backward, a write to `count`."""

    def __init__(self, dev):
        self.model = ratex.jit.script(Indexer()).to(dev)
        self.count = torch.zeros(3).to(dev)
        self.dev, self.warned = dev, []

    def __call__(self, idx):
        self.model.zero_grad(set_to_none=True)
        lazy = {k: v.to(self.dev) for k, v in idx.items()}
        outs = dict(zip(NAMES, self.model(*[lazy[k] for k in NAMES])))
        outs["nll_loss"] = F.nll_loss(outs["nll_loss"], lazy["nll_loss"])
        _loss(outs).backward()
        self.count.add_(1)
        lm.mark_step()
        return outs


FRONT_ENDS = {"lazy": LazyStep, "script": ScriptStep}


@pytest.fixture(scope="module")
def steps():
    """One step of each front end, compiled once for the module by its in-range run."""
    return {}


def _step(steps, front_end):
    step = steps.get(front_end)
    if step is None:
        step = steps[front_end] = FRONT_ENDS[front_end](torch.device("lazy", 0))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            step(indices())
            lm.wait_device_ops()
        step.warned = [str(w.message) for w in seen if "ratex" in str(w.message)]  # fallbacks, unscripted models
    return step


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_in_range_indices_give_cpus_results_without_extra_compiles(dev, steps, front_end):
    step = _step(steps, front_end)
    assert not step.warned
    metrics.reset()
    outs = step(indices())
    got = {k: v.detach().cpu() for k, v in outs.items()}
    want, gx, gw = cpu_reference(front_end == "script")
    torch.testing.assert_close(got, want)
    grads = (step.x.grad, step.w.grad) if front_end == "lazy" else (step.model.x.grad, step.model.w.grad)
    torch.testing.assert_close([g.cpu() for g in grads], [gx, gw])
    assert metrics.counter_value("UncachedCompile") is None
    assert metrics.counter_value("CachedCompile") == 1
    assert not [n for n in metrics.counter_names() if n.startswith("aten::")]


@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize("which", ["overrun", "negative"])
@pytest.mark.parametrize("name", NAMES)
def test_an_index_out_of_range_raises_index_error_and_rolls_the_step_back(dev, steps, front_end, which, name):
    step = _step(steps, front_end)
    before = step.count.cpu()
    (overrun, negative), dim = overruns(name)
    bad = overrun if which == "overrun" else negative
    metrics.reset()
    outs = step(indices(name, bad))
    size = CASES[name][1]
    where = f"dimension {dim} with size {size}" if dim >= 0 else f"a tensor of {size} elements"
    op = CASES[name][3]
    scripted = front_end == "script" and name != "nll_loss"
    if scripted:  # TorchScript's name of the op
        op = "aten::" + op.split(".")[1] + " in the forward"
    with pytest.raises(IndexError, match=f"index {bad} is out of bounds for {where} in {op}") as err:
        outs[name].cpu()
    assert isinstance(err.value, launch.ExecutionError)
    torch.testing.assert_close(step.count.cpu(), before)  # the failed step's write is rolled back
    with pytest.raises(IndexError):
        outs["embedding"].cpu()  # every value of the failed step
    assert metrics.counter_value("UncachedCompile") is None  # the same program, checks included
    if scripted:  # TorchScript names the user's line: here, in `ops`
        assert f"at {__file__}:" in str(err.value) and " in ops " in str(err.value)


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_training_goes_on_after_an_index_error(dev, steps, front_end):
    step = _step(steps, front_end)
    before = step.count.cpu()
    step(indices("embedding", 6))
    with pytest.raises(IndexError, match="out of bounds"):
        lm.wait_device_ops()
    outs = step(indices())
    want, _, _ = cpu_reference()
    torch.testing.assert_close(outs["embedding"].detach().cpu(), want["embedding"])
    torch.testing.assert_close(step.count.cpu(), before + 1)


def test_a_program_that_read_a_failed_programs_outputs_fails_with_it(dev, wrap_programs):
    """The second step reads w from the first while the first still runs (on the native runner,
    straight from its outputs, which are garbage read at clamped addresses): both roll back."""
    table = torch.randn(5, 3).to(dev)
    w = torch.ones(3).to(dev)
    lm.mark_step()
    lm.wait_device_ops()

    def slow(fn, inputs):
        time.sleep(0.05)
        return fn(*inputs)

    wrap_programs(slow)
    w.add_(F.embedding(torch.tensor([1, 9]).to(dev), table).sum(0))
    lm.mark_step()
    w.mul_(3)
    lm.mark_step()
    with pytest.raises(IndexError, match="index 9 is out of bounds for dimension 0 with size 5"):
        lm.wait_device_ops()
    torch.testing.assert_close(w.cpu(), torch.ones(3))
    w.add_(2)
    lm.mark_step()
    torch.testing.assert_close(w.cpu(), torch.full((3,), 3.0))


# Runs every op of tests/test_bounds.py with indices far out of range, on the front end argv[1]
# names, twice: compiled, then loaded from the disk cache (RATEX_CACHE_DIR); prints what each raised.
_FAR = """
import json, sys
import torch
import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex.core import sync
from ratex.lazy_tensor_core.debug import metrics
sys.path.insert(0, {here!r})
import test_bounds as tb

step = tb.FRONT_ENDS[sys.argv[1]](torch.device("lazy", 0))
step(tb.indices())
report = {{}}
for attempt in ("compiled", "from disk"):
    if attempt == "from disk":
        sync.reset_cache()
        metrics.reset()
    for name in tb.NAMES:
        for bad in (10**12, -10**12, -2**63):
            outs = step(tb.indices(name, bad))
            try:
                outs[name].cpu()
                report[f"{{attempt}} {{name}} {{bad}}"] = "no error"
            except IndexError as err:
                report[f"{{attempt}} {{name}} {{bad}}"] = str(err)
report["disk hits"] = metrics.counter_value("PersistentCacheHit")
print(json.dumps(report))
"""


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_indices_far_out_of_range_raise_without_touching_memory(front_end, tmp_path):
    env = dict(os.environ, RATEX_CACHE_DIR=str(tmp_path), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", _FAR.format(here=HERE), front_end], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]  # a segfault ends it with -11
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report.pop("disk hits")  # the second round ran programs loaded from disk
    for key, message in report.items():
        bad = key.rsplit(" ", 1)[1]
        assert f"index {bad} is out of bounds" in message, (key, message)


def test_a_checked_step_builds_for_cuda(dev, build_for_cuda):
    """Clamped accesses and check rows build as CUDA kernels too (running them needs a GPU)."""
    x, w, b = (t.to(dev) for t in _state())
    w.requires_grad_()
    outs = ops(x, w, b, indices(device=dev))
    _loss(outs).backward()
    step = graph.cut([o._value() for o in outs.values()] + [w.grad._value()])
    assert {"embedding_dense_backward.default", "index_put.default"} <= {n.op.__name__ for n in step.nodes}
    checks = []
    mod = tvm_lowering.import_graph(graph.to_fx(step), library=False, checks=checks)
    assert len(mod["main"].ret_ty.fields) == len(step.roots) + 1  # the check rows after the roots
    assert len(checks) >= len(NAMES)
    build_for_cuda(mod)
    lm.mark_step()  # leave nothing pending for other tests


def test_torch_compile_raises_index_error_at_the_call():
    """torch.compile(backend='ratex') runs its programs at the call, where PyTorch raises too."""
    x, w, b = _state()

    def fn(x, w, b, idx):
        outs = ops(x, w, b, dict(zip(NAMES, idx)))
        outs.pop("nll_loss")  # the same ops as on the lazy path, whose loss is separate
        return tuple(outs.values())

    compiled = torch.compile(fn, backend="ratex", dynamic=False)
    good = indices()
    torch.testing.assert_close(compiled(x, w, b, tuple(good.values())), fn(x, w, b, tuple(good.values())))
    for name in ("embedding", "gather", "index", "put"):
        for bad in overruns(name)[0]:
            with pytest.raises(IndexError, match=f"index {bad} is out of bounds .* in {CASES[name][3]}"):
                compiled(x, w, b, tuple(indices(name, bad).values()))


@pytest.mark.gpu
def test_torch_compile_on_cuda_raises_index_error_at_a_later_call():
    """On CUDA tensors the check is read once its copy lands, as eager CUDA's device-side assert
    surfaces later: a later program call (of the same graph where it has several regions, or of
    the next call) or lm.wait_device_ops() raises, naming the op. CUDA_LAUNCH_BLOCKING=1 raises at
    the program call that met it."""
    x, w, b = (t.cuda() for t in _state())

    def fn(x, w, b, idx):
        outs = ops(x, w, b, dict(zip(NAMES, idx)))
        outs.pop("nll_loss")
        return tuple(outs.values())

    compiled = torch.compile(fn, backend="ratex", dynamic=False)
    good, bad = indices(device="cuda"), indices("embedding", 6, device="cuda")
    want = fn(x.cpu(), w.cpu(), b.cpu(), tuple(indices().values()))
    torch.testing.assert_close(tuple(o.cpu() for o in compiled(x, w, b, tuple(good.values()))), want)
    match = "index 6 is out of bounds .* in aten.embedding.default.*found after the program that met it returned"
    with pytest.raises(IndexError, match=match):  # at a later program call: of this graph (other regions) or the next
        compiled(x, w, b, tuple(bad.values()))
        compiled(x, w, b, tuple(good.values()))
        lm.wait_device_ops()
    lm.wait_device_ops()  # nothing left unread
    with pytest.raises(IndexError, match=match):
        compiled(x, w, b, tuple(bad.values()))
        lm.wait_device_ops()
    os.environ["CUDA_LAUNCH_BLOCKING"] = "1"
    try:
        with pytest.raises(IndexError, match="index 6 is out of bounds .* in aten.embedding.default"):
            compiled(x, w, b, tuple(bad.values()))
    finally:
        del os.environ["CUDA_LAUNCH_BLOCKING"]
    torch.testing.assert_close(tuple(o.cpu() for o in compiled(x, w, b, tuple(good.values()))), want)
