"""ratex.data.DeviceLoader (batches moved to the device by a background thread, the step
marked for the user) and lm.optimizer_step."""
import threading

import pytest
import torch
import torch.nn.functional as F

import ratex
import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex.lazy_tensor_core.debug import metrics


class Batches:
    """A loader of `n` (x, {'y': y, 'tag': k}) batches that notes the thread taking each one and
    raises `fail` at batch `fail_at`."""

    def __init__(self, n, fail_at=None, fail=None):
        g = torch.Generator().manual_seed(0)
        self.items = [(torch.randn(4, 3, generator=g), {"y": torch.randint(0, 2, (4,), generator=g), "tag": k})
                      for k in range(n)]
        self.fail_at, self.fail = fail_at, fail
        self.threads = []

    def __iter__(self):
        for k, item in enumerate(self.items):
            if k == self.fail_at:
                raise self.fail
            self.threads.append(threading.current_thread().name)
            yield item

    def __len__(self):
        return len(self.items)


def test_batches_arrive_on_the_device_moved_by_a_background_thread(dev):
    source = Batches(5)
    loader = ratex.data.DeviceLoader(source, dev)
    assert len(loader) == 5
    got = list(loader)
    assert len(got) == 5
    for (x, meta), (want_x, want_meta) in zip(got, source.items):
        assert lm.is_lazy_tensor(x) and lm.is_lazy_tensor(meta["y"]) and meta["tag"] == want_meta["tag"]
        torch.testing.assert_close(x.cpu(), want_x, rtol=0, atol=0)
        assert torch.equal(meta["y"].cpu(), want_meta["y"])
    assert source.threads == ["ratex-device-loader"] * 5


@pytest.mark.parametrize("per_execution, marks", [(1, 5), (2, 3), (5, 1)])
def test_each_execution_of_batches_marks_a_step(dev, per_execution, marks):
    """Taking the batch after `per_execution` batches marks the step that used them, and the
    end of the data marks the last."""
    metrics.reset()
    seen = []
    for x, _ in ratex.data.DeviceLoader(Batches(5), dev, batches_per_execution=per_execution):
        seen.append(metrics.counter_value("MarkStep") or 0)
        (x * 2).sum()
    assert seen == [k // per_execution for k in range(5)]
    assert metrics.counter_value("MarkStep") == marks


def test_training_through_the_loader_equals_moving_batches_by_hand(dev):
    def train(feed, barrier):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for x, meta in feed:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), meta["y"])
            loss.backward()
            lm.optimizer_step(opt, barrier=barrier)  # a DeviceLoader marks the step itself
            losses.append(loss)
        lm.mark_step()
        return [loss.item() for loss in losses], [p.cpu() for p in model.parameters()]

    source = Batches(6)
    by_hand = ((x.to(dev), {"y": meta["y"].to(dev), "tag": meta["tag"]}) for x, meta in source.items)
    want_losses, want_params = train(by_hand, barrier=True)
    metrics.reset()
    got_losses, got_params = train(ratex.data.DeviceLoader(source, dev), barrier=False)
    assert got_losses == want_losses
    torch.testing.assert_close(got_params, want_params, rtol=0, atol=0)
    assert metrics.counter_value("MarkStep") == 6 + 1  # one per batch, and the one after the loop


def test_the_loaders_error_is_raised_in_the_training_loop(dev):
    loader = ratex.data.DeviceLoader(Batches(4, fail_at=2, fail=ValueError("bad record 2")), dev)
    it = iter(loader)
    next(it), next(it)
    with pytest.raises(ValueError, match="bad record 2"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_breaking_out_early_stops_the_background_thread(dev):
    it = iter(ratex.data.DeviceLoader(Batches(50), dev, device_prefetch_size=1))
    next(it)
    it.close()
    it._thread.join(timeout=10)
    assert not it._thread.is_alive()


@pytest.mark.parametrize("kwargs, message", [
    ({"device": "cpu"}, "moves batches to the lazy device, not cpu"),
    ({"batches_per_execution": 0}, "batches_per_execution=0; use a whole number of at least 1"),
    ({"device_prefetch_size": 1.5}, "device_prefetch_size=1.5; use a whole number"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ratex.data.DeviceLoader([], **kwargs)


def test_optimizer_step_reduces_steps_and_marks_only_with_a_barrier(dev, monkeypatch):
    model = torch.nn.Linear(3, 1).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    reduced = []
    monkeypatch.setattr(lm, "reduce_gradients", lambda o: reduced.append(o))
    before = model.weight.detach().cpu()
    model(torch.ones(2, 3).to(dev)).sum().backward()
    metrics.reset()
    assert lm.optimizer_step(opt) is None
    assert reduced == [opt] and metrics.counter_value("MarkStep") is None
    torch.testing.assert_close(model.weight.detach().cpu(), before - 0.5 * 2)
    assert lm.optimizer_step(opt, barrier=True, optimizer_args={"closure": lambda: 7.0}) == 7.0
    assert metrics.counter_value("MarkStep") == 1
