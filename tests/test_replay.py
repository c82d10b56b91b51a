"""mark_step's replayed cuts (ratex/core/graph.py `replay`): a step whose graph has the key of a
recent one is found from that key with no walk, and any difference the key would see makes
it cut afresh. Every step is compared with CPU PyTorch; a stale replay would run the program
of the step before."""
import pytest
import torch

import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex.core import graph, sync


@pytest.fixture
def cuts(monkeypatch):
    """The number of cuts made so far (replayed steps make none), from no remembered keys."""
    graph.forget()
    count = [0]
    real = sync.cut

    def counting(roots):
        count[0] += 1
        return real(roots)

    monkeypatch.setattr(sync, "cut", counting)
    yield count
    graph.forget()


def _run(dev, step, *args):
    """step(*args) on the lazy device, marked, read back; and on the CPU."""
    got = step(*[a.to(dev) for a in args])
    lm.mark_step()
    return [g.cpu() for g in got], step(*args)


def _check(dev, step, *args):
    got, want = _run(dev, step, *args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_a_repeated_step_is_replayed(dev, cuts):
    def step(x, w):
        return [torch.relu(x @ w).sum(0), (x * 2).mean()]

    x, w = torch.randn(3, 4), torch.randn(4, 5)
    for k in range(4):
        _check(dev, step, x + k, w)
    assert cuts[0] == 1


def test_a_changed_python_scalar_is_another_graph(dev, cuts):
    """An exponent is part of the key (ints and 0 or 1 are not lifted to inputs)."""
    x = torch.rand(3, 4) + 0.5
    for k in (2, 3, 2, 0, 1):
        _check(dev, lambda x: [x.pow(k), x.sum(dim=k % 2)], x)
    assert cuts[0] == 4  # 2 replays 2; the others are new


def test_one_tensor_used_twice_is_not_two_tensors(dev, cuts):
    """A graph of one input read twice (a + a) must not replay for two inputs (a + b), nor the
    other way round: the program would read one buffer for both."""
    a, b = torch.randn(5), torch.randn(5)
    step = lambda x, y: [x * y + x]  # noqa: E731
    for x, y in ((a, a), (a, b), (a, a), (b, a)):
        dx = x.to(dev)
        dy = dx if y is x else y.to(dev)
        out = step(dx, dy)[0]
        lm.mark_step()
        torch.testing.assert_close(out.cpu(), step(x, y)[0])
    assert cuts[0] == 2  # (a, a) and (b, a) replay the graphs of the first two steps


def test_an_input_computed_or_pending_is_another_graph(dev, cuts):
    """The same ops where an input was computed by an earlier sync (a leaf) or not (a node)."""
    x = torch.randn(4, 4)
    for read in (False, True, False, True):
        d = x.to(dev)
        h = d.sin()
        if read:
            h.cpu()  # computes h: the graph below starts from it
        out = (h * 3).exp()
        lm.mark_step()
        torch.testing.assert_close(out.cpu(), (x.sin() * 3).exp())


def test_writes_through_views_and_branches(dev, cuts):
    """In-place writes through a view and Python branches change the graph from step to step."""
    def step(x, k):
        y = x.clone()
        if k % 2:
            y[1:3].mul_(k)
        else:
            y.t_()
            y[0].add_(k)
        return [y, y.sum()]

    x = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    for k in range(6):
        _check(dev, lambda x: step(x, k), x)


def test_a_new_shape_is_another_graph(dev, cuts):
    w = torch.randn(6, 3)
    for n in (2, 5, 2, 5):
        _check(dev, lambda x, w: [torch.tanh(x @ w)], torch.randn(n, 6), w)
    assert cuts[0] == 2


def test_training_steps_replay_and_read_mid_step(dev, cuts):
    """A training loop that reads its loss inside every other step: two cuts in such a step (the
    loss, then the step), one in the others; from step 2 on every graph is replayed."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    ref.load_state_dict(model.state_dict())
    model.to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    batches = [(torch.randn(4, 6), torch.randint(0, 3, (4,))) for _ in range(3)]
    for k in range(8):
        x, y = batches[k % 3]
        for m, o, dx, dy in ((model, opt, x.to(dev), y.to(dev)), (ref, ref_opt, x, y)):
            o.zero_grad()
            loss = torch.nn.functional.cross_entropy(m(dx), dy)
            loss.backward()
            if k % 2 and m is model:
                got = loss.item()
            o.step()
            if m is ref:
                want = loss.item()
        lm.mark_step()
        if k % 2:
            assert got == pytest.approx(want, rel=1e-5)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-6)
    # step 0 makes the momentum buffers; step 1 reads the loss (the forward) and then cuts the
    # whole step (the forward again, for the gradients), which every later step replays; later
    # reads replay theirs
    assert cuts[0] == 3

