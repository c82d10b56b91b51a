"""ratex.jit.script on calls with keywords and structured outputs, and through torch.export."""
import copy
import dataclasses
import warnings
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ratex import jit
from ratex.lazy_tensor_core.core import lazy_model as lm
from ratex.lazy_tensor_core.debug import metrics

RTOL, ATOL = 1e-4, 1e-5


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def _fallbacks():
    return [n for n in metrics.counter_names() if n.startswith("aten::")]


@dataclasses.dataclass
class Result:
    """A plain dataclass output (not a pytree node), like the outputs of many model zoos."""

    logits: torch.Tensor
    loss: Optional[torch.Tensor] = None


class KwHead(nn.Module):
    """Called like a Hugging Face model: an optional mask and labels, keyword-only options."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x, mask=None, labels=None, *, scale=1.0, return_dict=True):
        h = torch.tanh(self.fc(x)) * scale
        if mask is not None:
            h = h * mask.unsqueeze(-1).to(h.dtype)
        logits = self.out(h)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        if not return_dict:
            return {"logits": logits} if loss is None else {"loss": loss, "logits": logits}
        return Result(logits=logits, loss=loss)


def _pair(cls, seed=0):
    torch.manual_seed(seed)
    ref = cls()
    return copy.deepcopy(ref), ref


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


def _train_with_keywords(model, ref, dev, steps=3, **options):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0])
    for step in range(steps):
        x, y = _batch(step)
        out = model(x.to(dev), mask=mask.to(dev), labels=y.to(dev), **options)
        ref_out = ref(x, mask=mask, labels=y, **options)
        assert type(out) is type(ref_out)
        loss = out.loss if isinstance(out, Result) else out["loss"]
        ref_loss = ref_out.loss if isinstance(ref_out, Result) else ref_out["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        lm.mark_step()
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        _close(loss.detach().cpu(), ref_loss.detach())
    for p, q in zip(model.parameters(), ref.parameters()):
        _close(p.detach().cpu(), q.detach())


@pytest.mark.parametrize("captures", [("trace",), ("export",)])
def test_keyword_call_trains_like_cpu_returning_the_models_structure(dev, captures):
    model, ref = _pair(KwHead)
    model = jit.script(model.to(dev), captures)
    _train_with_keywords(model, ref, dev)
    assert metrics.counter_value("ratex::script_fwd.default") == 3
    assert metrics.counter_value("ratex::script_bwd.default") == 3
    assert not _fallbacks(), metrics.counter_names()


def test_dict_output_with_keyword_only_options_trains_like_cpu(dev):
    model, ref = _pair(KwHead, seed=1)
    model = jit.script(model.to(dev))
    _train_with_keywords(model, ref, dev, scale=0.5, return_dict=False)
    assert metrics.counter_value("ratex::script_fwd.default") == 3
    assert not _fallbacks(), metrics.counter_names()


def test_the_signature_key_is_which_arguments_were_given_and_their_values(dev):
    """None vs a tensor, and each non-tensor value, make a new script; the same call reuses one."""
    model, ref = _pair(KwHead, seed=2)
    model = jit.script(model.to(dev))
    x, y = _batch(5)
    mask = torch.tensor([0.0, 1.0, 1.0, 1.0])
    calls = [
        ((x,), {}),
        ((x,), {"mask": mask}),
        ((x, mask), {}),  # the same arguments bound positionally: the same script
        ((x,), {"labels": y, "scale": 2.0}),
        ((x,), {"labels": y, "scale": 3.0}),
        ((x,), {"labels": y, "scale": 3.0}),
        ((x,), {"labels": y, "return_dict": False}),
    ]
    before = len(jit._scripts)
    with torch.no_grad():
        for args, kwargs in calls:
            out = model(*[a.to(dev) for a in args], **{k: v.to(dev) if torch.is_tensor(v) else v
                                                     for k, v in kwargs.items()})
            ref_out = ref(*args, **kwargs)
            assert type(out) is type(ref_out)
            got = dataclasses.asdict(out) if isinstance(out, Result) else out
            want = dataclasses.asdict(ref_out) if isinstance(ref_out, Result) else ref_out
            assert got.keys() == want.keys()
            for k in want:
                if want[k] is None:
                    assert got[k] is None
                else:
                    _close(got[k].cpu(), want[k])
    assert len(jit._scripts) - before == 5
    assert metrics.counter_value("ratex::script_fwd.default") == len(calls)


def test_calls_the_signature_rejects_get_the_models_own_error(dev):
    model = jit.script(KwHead().to(dev))
    x = torch.randn(4, 6).to(dev)
    with pytest.raises(TypeError, match="unexpected keyword argument 'labelz'"):
        model(x, labelz=x)


class WritesThroughAView(nn.Module):
    """Writes into a slice of an intermediate: a TorchScript graph doesn't say what aliases what."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        h = self.fc(x)
        h[:, 1] = 0.0
        h[:, 2:] *= 2.0
        return torch.tanh(h)


def test_export_captures_what_the_trace_converter_refuses(dev):
    model, ref = _pair(WritesThroughAView)
    model = jit.script(model.to(dev))
    x = torch.randn(3, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model(x.to(dev))
    ref_out = ref(x)
    out.sum().backward()
    ref_out.sum().backward()
    _close(out.detach().cpu(), ref_out.detach())
    for p, q in zip(model.parameters(), ref.parameters()):
        _close(p.grad.cpu(), q.grad)
    assert metrics.counter_value("ratex::script_fwd.default") == 1
    assert metrics.counter_value("ratex::script_bwd.default") == 1

    traced_only = jit.script(copy.deepcopy(ref).to(dev), captures=("trace",))
    with pytest.warns(UserWarning, match="torch.jit.trace: cannot convert to Relax: .*writes to a view"):
        out = traced_only(x.to(dev))
    _close(out.detach().cpu(), ref_out.detach())


def test_unknown_capture_names_raise():
    with pytest.raises(ValueError, match="'dynamo'"):
        jit.script(KwHead(), captures=("trace", "dynamo"))
    with pytest.raises(ValueError, match=r"\(\)"):
        jit.script(KwHead(), captures=())


class HoldsModel(nn.Module):
    """Names its body `model`, as Hugging Face's decoders do (`LlamaForCausalLM.model`)."""

    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(6, 5), nn.Tanh())
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.model(x))


def test_export_captures_a_model_with_a_submodule_named_model(dev):
    """The capture's own wrapper must not shadow the model's submodules: torch.export looks up
    `model.0.weight` through it."""
    model, ref = _pair(HoldsModel)
    model = jit.script(model.to(dev), captures=("export",))
    x = torch.randn(4, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model(x.to(dev))
    ref_out = ref(x)
    out.sum().backward()
    ref_out.sum().backward()
    lm.mark_step()
    _close(out.detach().cpu(), ref_out.detach())
    for p, q in zip(model.parameters(), ref.parameters()):
        _close(p.grad.cpu(), q.grad)
    assert metrics.counter_value("ratex::script_fwd.default") == 1
    assert metrics.counter_value("ratex::script_bwd.default") == 1
