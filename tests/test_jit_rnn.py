"""Recurrent models: LSTM/GRU/RNN unrolled over time steps in a script's forward, under
ratex.jit.script and, as one script node per call, on the plain lazy device."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ratex import jit
from ratex.lazy_tensor_core.core import lazy_model as lm
from ratex.lazy_tensor_core.debug import metrics

RTOL, ATOL = 1e-4, 1e-5
VOCAB, HIDDEN, BATCH, STEPS = 40, 16, 3, 7


class RnnLM(nn.Module):
    """Embedding -> 2-layer batch_first RNN -> linear, with an optional initial state."""

    def __init__(self, cell=nn.LSTM, bidirectional=False, bias=True):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 12)
        self.rnn = cell(12, HIDDEN, num_layers=2, batch_first=True, bidirectional=bidirectional, bias=bias)
        self.out = nn.Linear(HIDDEN * (2 if bidirectional else 1), VOCAB)

    def forward(self, ids, state=None):
        y, _ = self.rnn(self.emb(ids), state)
        return self.out(y)


def _state(cell, bidirectional, gen):
    dirs = 4 if bidirectional else 2
    h = torch.randn(dirs, BATCH, HIDDEN, generator=gen)
    return (h, torch.randn(dirs, BATCH, HIDDEN, generator=gen)) if cell is nn.LSTM else h


def _to(state, dev):
    if state is None:
        return None
    return tuple(s.to(dev) for s in state) if isinstance(state, tuple) else state.to(dev)


@pytest.mark.parametrize(
    "cell, bidirectional, with_state, bias",
    [(nn.LSTM, False, False, True), (nn.GRU, True, True, True), (nn.RNN, False, True, False)],
    ids=["lstm", "gru-bidirectional-state", "rnn-state-nobias"],
)
@pytest.mark.parametrize("scripted", [True, False], ids=["scripted", "plain"])
def test_rnn_language_model_trains_like_cpu_in_one_script_node(dev, cell, bidirectional, with_state, bias, scripted):
    torch.manual_seed(0)
    ref = RnnLM(cell, bidirectional, bias)
    model = copy.deepcopy(ref).to(dev)
    if scripted:
        model = jit.script(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, VOCAB, (BATCH, STEPS), generator=gen)
        state = _state(cell, bidirectional, gen) if with_state else None
        target = ids.roll(-1, 1).flatten()
        loss = F.cross_entropy(model(ids.to(dev), _to(state, dev)).flatten(0, 1), target.to(dev))
        opt.zero_grad()
        loss.backward()
        opt.step()
        lm.mark_step()
        ref_loss = F.cross_entropy(ref(ids, state).flatten(0, 1), target)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss.detach().cpu(), ref_loss.detach(), rtol=RTOL, atol=ATOL)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=RTOL, atol=ATOL)
    # Scripted: the whole forward is one node; plain: the RNN call is, the rest records as usual.
    assert metrics.counter_value("ratex::script_fwd.default") == 3
    assert metrics.counter_value("ratex::script_bwd.default") == 3
    fallbacks = [n for n in metrics.counter_names() if n.startswith("aten::")]
    assert not fallbacks, fallbacks


def test_lstm_gradient_reaches_the_initial_state(dev):
    torch.manual_seed(1)
    ref = nn.LSTM(5, 6, num_layers=2)  # time-major input: (steps, batch, features)
    model = jit.script(copy.deepcopy(ref).to(dev))
    x = torch.randn(4, 2, 5)
    h0, c0 = torch.randn(2, 2, 6), torch.randn(2, 2, 6)
    lazy = [t.to(dev).requires_grad_(True) for t in (x, h0, c0)]
    cpu = [t.clone().requires_grad_(True) for t in (x, h0, c0)]
    y, (h, c) = model(lazy[0], (lazy[1], lazy[2]))
    ry, (rh, rc) = ref(cpu[0], (cpu[1], cpu[2]))
    (y.square().sum() + h.sum() + 2 * c.sum()).backward()
    (ry.square().sum() + rh.sum() + 2 * rc.sum()).backward()
    for got, want in zip((y, h, c), (ry, rh, rc)):
        torch.testing.assert_close(got.detach().cpu(), want.detach(), rtol=RTOL, atol=ATOL)
    for got, want in zip(lazy, cpu):
        torch.testing.assert_close(got.grad.cpu(), want.grad, rtol=RTOL, atol=ATOL)
    assert metrics.counter_value("ratex::script_fwd.default") == 1


def test_plain_lazy_rnn_with_dropout_between_layers_is_one_node_and_eval_matches_cpu(dev):
    torch.manual_seed(2)
    ref = nn.GRU(5, 6, num_layers=3, dropout=0.3, batch_first=True)
    model = copy.deepcopy(ref).to(dev)
    x = torch.randn(2, 4, 5)
    y, h = model(x.to(dev))  # training: masks between layers, drawn on the lazy device
    (y.sum() + h.sum()).backward()
    lm.mark_step()
    assert all(p.grad is not None and torch.isfinite(p.grad.cpu()).all() for p in model.parameters())
    assert metrics.counter_value("ratex::script_fwd.default") == 1
    assert metrics.counter_value("ratex::script_bwd.default") == 1
    model.eval()
    ref.eval()
    with torch.no_grad():
        y, h = model(x.to(dev))
        ry, rh = ref(x)
    torch.testing.assert_close(y.cpu(), ry, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(h.cpu(), rh, rtol=RTOL, atol=ATOL)
    assert not [n for n in metrics.counter_names() if n.startswith("aten::")]


def test_plain_lazy_lstm_the_builder_refuses_records_pytorchs_decomposition(dev):
    """proj_size has no unrolling here: the call decomposes as before, and still matches CPU."""
    torch.manual_seed(3)
    ref = nn.LSTM(5, 6, proj_size=3, batch_first=True)
    model = copy.deepcopy(ref).to(dev)
    x = torch.randn(2, 4, 5)
    y, (h, c) = model(x.to(dev))
    ry, (rh, rc) = ref(x)
    (y.sum() + c.sum()).backward()
    (ry.sum() + rc.sum()).backward()
    for got, want in zip((y, h, c), (ry, rh, rc)):
        torch.testing.assert_close(got.detach().cpu(), want.detach(), rtol=RTOL, atol=ATOL)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=RTOL, atol=ATOL)
    assert metrics.counter_value("ratex::script_fwd.default") is None


def test_plain_lazy_rnn_under_autocast_keeps_the_decomposition_that_autocast_casts(dev):
    import ratex

    model = nn.GRU(5, 6, batch_first=True).to(dev)
    x = torch.randn(2, 3, 5).to(dev)
    with ratex.amp.autocast(dtype=torch.bfloat16):
        model(x)
    assert metrics.counter_value("ratex::script_fwd.default") is None
    model(x)
    assert metrics.counter_value("ratex::script_fwd.default") == 1
