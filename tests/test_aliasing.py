"""ENABLE_PARAM_ALIASING: a step writes parameters and optimizer state into their own buffers.

On the CPU backend device data are torch tensors shared with TVM through
DLPack, so "written in place" is checked by comparing data pointers.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex import config, jit
from ratex.core import sync
from ratex.lazy_tensor_core.debug import metrics

from test_optimizers import OPTIMIZERS

RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture
def aliasing(monkeypatch):
    monkeypatch.setattr(config, "PARAM_ALIASING", True)


def _ptr(t):
    return t._device_data().data_ptr()


def _state(opt):
    """The optimizer's lazy state tensors (momentum, exp_avg, ...), in a fixed order."""
    return [v for p in opt.param_groups[0]["params"] for k, v in sorted(opt.state[p].items())
            if isinstance(v, torch.Tensor) and v.device.type == "lazy"]


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _batches(n=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 8, generator=g), torch.randint(0, 4, (5,), generator=g)) for _ in range(n)]


def _optimizer(name, foreach):
    """torch.optim's optimizer `name`; foreach=None is the default (foreach for lazy parameters, as on CUDA)."""
    def make(params):
        opt = OPTIMIZERS[name](params)
        for group in opt.param_groups:
            group["foreach"] = foreach
        return opt
    return make


def _train_lazy(model, make_opt, dev, batches, script=False):
    """Train on the lazy device; return losses, final weights, which buffers moved per step, compile counts."""
    model = copy.deepcopy(model).to(dev)
    if script:
        model = jit.script(model)
    opt = make_opt(model.parameters())
    losses, moved, compiles = [], [], []
    for x, y in batches:
        tensors = list(model.parameters()) + _state(opt)
        before = [_ptr(t) for t in tensors]
        opt.zero_grad()
        loss = F.cross_entropy(model(x.to(dev)), y.to(dev))
        loss.backward()
        opt.step()
        lm.mark_step()
        lm.wait_device_ops()
        moved.append([b != _ptr(t) for b, t in zip(before, tensors)])
        losses.append(loss.item())
        compiles.append(metrics.counter_value("UncachedCompile"))
    return losses, [p.cpu() for p in model.parameters()], moved, compiles


def _train_cpu(model, make_opt, batches):
    model = copy.deepcopy(model)
    opt = make_opt(model.parameters())
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach() for p in model.parameters()]


def _check(make_opt, dev, monkeypatch, script=False, against_off=False):
    """Train with aliasing on: same numbers as CPU (and the aliasing-off run), buffers never move."""
    model, batches = _mlp(), _batches()
    expected = [_train_cpu(model, make_opt, batches)]
    if against_off:
        monkeypatch.setattr(config, "PARAM_ALIASING", False)
        off_losses, off_weights, off_moved, _ = _train_lazy(model, make_opt, dev, batches, script)
        expected.append((off_losses, off_weights))
        assert all(all(step) for step in off_moved)  # without aliasing each step moves every buffer
    monkeypatch.setattr(config, "PARAM_ALIASING", True)
    metrics.reset()
    sync.reset_cache()  # donations are counted when a program compiles: another test may have compiled this one
    losses, weights, moved, compiles = _train_lazy(model, make_opt, dev, batches, script)
    for ref_losses, ref_weights in expected:
        torch.testing.assert_close(losses, ref_losses, rtol=RTOL, atol=ATOL)
        for w, r in zip(weights, ref_weights):
            torch.testing.assert_close(w, r, rtol=RTOL, atol=ATOL)
    # Every parameter and state tensor keeps its buffer at every step (the state made at
    # the first step from the second on).
    for step in moved:
        assert step and not any(step), f"buffers that moved at a step: {step}"
    assert len(set(compiles[1:])) == 1, f"recompiled after the first steps: {compiles}"
    assert metrics.counter_value("DonatedBuffers") >= len(weights)
    assert not [c for c in metrics.counter_names() if c.startswith("aten::")]  # every op compiled


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_foreach_step_writes_in_place(dev, monkeypatch, name):
    _check(_optimizer(name, foreach=True), dev, monkeypatch)


@pytest.mark.parametrize("name", ["sgd-nesterov-wd", "adam"])
def test_default_step_writes_in_place_like_aliasing_off(dev, monkeypatch, name):
    _check(_optimizer(name, foreach=None), dev, monkeypatch, against_off=True)


def test_scripted_step_writes_in_place(dev, monkeypatch):
    _check(_optimizer("adamw", foreach=True), dev, monkeypatch, script=True)


def test_view_sees_update_and_clone_keeps_old_value(dev, aliasing):
    w = torch.arange(12.0).reshape(3, 4).to(dev)
    lm.mark_step()
    row, before, kept = w[1], w.clone(), w.cpu()
    w.mul_(2).add_(1)
    lm.mark_step()
    torch.testing.assert_close(row.cpu(), kept[1] * 2 + 1)
    torch.testing.assert_close(before.cpu(), kept)  # the clone needs the old value: w wasn't donated
    ptr = _ptr(w)
    w.add_(1)  # nothing else needs w's value now: written in place
    lm.mark_step()
    assert _ptr(w) == ptr
    torch.testing.assert_close(before.cpu(), kept)
    torch.testing.assert_close(w.cpu(), kept * 2 + 2)
    torch.testing.assert_close(row.cpu(), kept[1] * 2 + 2)


def test_old_value_read_after_update_is_not_overwritten(dev, aliasing):
    w = torch.arange(16.0).reshape(4, 4).to(dev)
    lm.mark_step()
    ptr, kept = _ptr(w), w.cpu()
    old = w.clone()
    w.add_(1)
    later = old * 3  # recorded after the update, computed in the same program from the old value
    del old
    lm.mark_step()
    torch.testing.assert_close(later.cpu(), kept * 3)
    torch.testing.assert_close(w.cpu(), kept + 1)
    assert _ptr(w) != ptr


def test_update_reading_other_elements_is_not_in_place(dev, aliasing):
    w = torch.arange(16.0).reshape(4, 4).to(dev)
    lm.mark_step()
    ptr, kept = _ptr(w), w.cpu()
    w.copy_(w.t() + 1)  # element (i, j) needs old (j, i): writing in place would read new values
    lm.mark_step()
    torch.testing.assert_close(w.cpu(), kept.t() + 1)
    assert _ptr(w) != ptr


def test_two_tensors_never_share_a_buffer(dev, aliasing):
    w = torch.ones(8).to(dev)
    a = w.add(1)
    b = a.view(2, 4).view(8)  # a view: sees a's updates
    c = a.clone()  # a copy: must not share a's buffer once computed
    lm.mark_step()
    assert _ptr(a) != _ptr(c)
    a.mul_(10)
    lm.mark_step()
    torch.testing.assert_close(c.cpu(), torch.full((8,), 2.0))
    torch.testing.assert_close(b.cpu(), torch.full((8,), 20.0))


def test_failed_step_does_not_restore_donated_buffers(dev, aliasing, monkeypatch, wrap_programs):
    from ratex.core import launch

    w, u, v = torch.ones(4).to(dev), torch.zeros(4).to(dev), torch.ones(4).to(dev)
    lm.mark_step()
    w.add_(1)
    u.copy_(v * 5)  # doesn't read its old value: nothing to donate, so it can roll back

    def fail(fn, inputs):
        raise RuntimeError("injected failure")

    wrap_programs(fail)
    lm.mark_step()
    with pytest.raises(launch.ExecutionError, match="writing in place"):
        lm.wait_device_ops()
    with pytest.raises(launch.ExecutionError, match="injected failure"):
        w.cpu()  # its old buffer was handed to the failed program: no silent stale value
    monkeypatch.undo()
    torch.testing.assert_close(u.cpu(), torch.zeros(4))


def test_donate_pass_rewrites_only_safe_calls():
    import tvm
    from tvm.relax.backend.cpu_generic import pipeline as cpu
    from tvm.script import ir as I, relax as R

    from tvm_lowering import inplace
    from tvm_lowering.schedules import cpu_schedule

    @I.ir_module
    class Step:
        @R.function
        def main(p: R.Tensor((16, 8), "float32"), g: R.Tensor((16, 8), "float32"),
                 m: R.Tensor((16, 8), "float32"), lr: R.Tensor((), "float32"), x: R.Tensor((4, 8), "float32"),
                 s: R.Tensor((8, 8), "float32")):
            with R.dataflow():
                y = R.matmul(x, R.permute_dims(p))  # reads p before its update: fine
                m2 = R.add(R.multiply(m, R.const(0.9, "float32")), g)
                p2 = R.subtract(p, R.multiply(lr, m2))
                flat = R.reshape(m, (128,))  # a view of m, returned: m's buffer must survive
                st = R.add(R.permute_dims(s), R.const(1.0, "float32"))  # element (i, j) needs old (j, i)
                gv = (y, m2, p2, flat, st)
                R.output(gv)
            return gv

    with tvm.target.Target("llvm"):  # as in the real pipeline: fused and scheduled (transpose inlined)
        mod = tvm.transform.Sequential(cpu.legalize_passes(None) + [cpu_schedule()])(Step)
    done = []
    new = inplace.donate([(0, 2), (2, 1), (5, 4)], done)(mod)
    assert done == [(0, 2)]
    text = new["main"].script()
    assert text.count("call_tir_inplace") == 1 and "inplace_indices=[2]" in text


def test_accumulator_made_by_a_factory_is_not_a_shared_constant(dev, monkeypatch):
    # torch.zeros(()) compiles to a constant the program returns on every run; a step that
    # donates it (total += loss) must not write into that constant (the next epoch's zeros).
    monkeypatch.setattr(config, "PARAM_ALIASING", True)
    w = torch.ones(3, device=dev)
    totals = []
    for _ in range(3):
        total = torch.zeros((), device=dev)
        for _ in range(3):
            loss = (w * 2).sum()
            lm.mark_step()
            total += loss.detach()
        totals.append(total.item())
    assert totals == [18.0, 18.0, 18.0]


@pytest.mark.parametrize("aliased", [False, True])
def test_clone_strides_follow_memory_format(dev, monkeypatch, aliased):
    # reshape of a tensor it can't view clones it contiguous first (a transposed attention
    # projection did so, and with aliasing on the clone kept the transposed strides)
    monkeypatch.setattr(config, "PARAM_ALIASING", aliased)
    for d in (torch.device("cpu"), dev):
        x = torch.arange(24.0, device=d).reshape(2, 3, 4).transpose(0, 1)
        kept = x.clone()
        assert kept.stride() == (4, 12, 1)
        flat = x.reshape(6, 4)
        assert flat.stride() == (4, 1)
        assert x.clone(memory_format=torch.contiguous_format).stride() == (8, 4, 1)
        if d == dev:
            lm.mark_step()
            torch.testing.assert_close(flat.cpu(), want)
            torch.testing.assert_close(kept.cpu(), x.cpu())
        want = flat


def test_leaves_sharing_a_buffer_are_never_donated():
    """A buffer two leaves of a graph hold -- the same data, or a finished run's Pending and its
    result -- must not be written in place: sync._shared_leaves names exactly those leaves."""
    from ratex.core import launch, sync
    from ratex.core.ir import Meta, Node

    meta = Meta((2,), torch.float32)
    a, b, c = torch.zeros(2), torch.ones(2), torch.full((2,), 2.0)
    done = launch.Pending(None, 0)
    done.data = c  # a finished run's output, also held as data by another leaf
    running = launch.Pending(None, 1)  # its run still going: no data yet

    def leaves(*datas):
        return [(Node.leaf(d, meta), 0) for d in datas]

    assert sync._shared_leaves(leaves(a, b, running)) == set()
    assert sync._shared_leaves(leaves(a, b, a)) == {0, 2}
    assert sync._shared_leaves(leaves(a, done, b, c)) == {1, 3}
