"""Parameters and modules across devices: tying survives `.to()`; checkpoints save and load as torch's do."""
import copy
import io
import pickle

import pytest
import torch
from torch import nn

import ratex.lazy_tensor_core.core.lazy_model as lm


class TiedLM(nn.Module):
    """An embedding whose matrix is also the output projection (GPT-2's wte and lm_head)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def _loss(model, ids):
    return nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


def _tied_pair():
    torch.manual_seed(0)
    cpu = TiedLM()
    return cpu, copy.deepcopy(cpu)


def test_to_lazy_keeps_tied_parameters_one_tensor(dev):
    cpu, model = _tied_pair()
    ids = torch.randint(0, 50, (2, 5))
    model.to(dev)
    assert model.head.weight is model.emb.weight, "the tied head came apart"
    assert model.emb.weight.device == dev and isinstance(model.emb.weight, nn.Parameter)
    assert len(list(model.parameters())) == len(list(cpu.parameters())) == 3
    _loss(cpu, ids).backward()
    _loss(model, ids.to(dev)).backward()
    torch.testing.assert_close(model.emb.weight.grad.cpu(), cpu.emb.weight.grad)


def test_tied_model_trains_like_cpu_with_optimizers_built_before_and_after_to(dev):
    cpu, model = _tied_pair()
    before = torch.optim.SGD(model.parameters(), lr=0.5)  # built on the CPU parameters, as CUDA allows
    model.to(dev)
    after = torch.optim.AdamW(model.parameters(), lr=0.05)
    ref_sgd, ref_adam = torch.optim.SGD(cpu.parameters(), lr=0.5), torch.optim.AdamW(cpu.parameters(), lr=0.05)
    torch.manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 50, (2, 5))
        for m, opts, x in ((cpu, (ref_sgd, ref_adam), ids), (model, (before, after), ids.to(dev))):
            for o in opts:
                o.zero_grad()
            loss = _loss(m, x)
            loss.backward()
            for o in opts:
                o.step()
        lm.mark_step()
        torch.testing.assert_close(model.emb.weight.cpu(), cpu.emb.weight, rtol=1e-4, atol=1e-5)
    assert model.head.weight is model.emb.weight, "the tied head came apart"


def test_tied_parameters_and_their_grads_move_back_to_cpu_and_change_dtype(dev):
    cpu, model = _tied_pair()
    model.to(dev)
    ids = torch.randint(0, 50, (2, 5))
    _loss(model, ids.to(dev)).backward()
    _loss(cpu, ids).backward()
    model.to(torch.float64)  # a conversion on the lazy device keeps the tie and moves the grad along
    assert model.head.weight is model.emb.weight, "the tie came apart"
    assert model.emb.weight.dtype == torch.float64 and model.emb.weight.grad.dtype == torch.float64
    model.to("cpu")
    for name, p in model.named_parameters(remove_duplicate=False):
        assert type(p) is nn.Parameter and p.device.type == "cpu" and p.requires_grad, name
        want = cpu.get_parameter(name)
        torch.testing.assert_close(p.float(), want)
        torch.testing.assert_close(p.grad.float(), want.grad)


def test_deepcopy_and_pickle_of_a_tied_lazy_model_keep_the_tie(dev):
    _, model = _tied_pair()
    model.to(dev)
    twin = copy.deepcopy(model)
    assert twin.head.weight is twin.emb.weight, "the copy's tie came apart"
    assert twin.emb.weight is not model.emb.weight
    assert twin.emb.weight.device == dev and isinstance(twin.emb.weight, nn.Parameter)
    torch.testing.assert_close(twin.emb.weight.cpu(), model.emb.weight.cpu())
    loaded = pickle.loads(pickle.dumps(model))  # lazy tensors pickle as the CPU tensors they hold
    assert loaded.head.weight is loaded.emb.weight, "the unpickled tie came apart"
    assert type(loaded.mid.bias) is nn.Parameter and loaded.mid.bias.device.type == "cpu"
    torch.testing.assert_close(loaded.mid.bias, model.mid.bias.cpu())


# ---- torch.save / torch.load ----------------------------------------------------------------
def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _lazy_checkpoint(dev):
    _, model = _tied_pair()
    model.to(dev)
    grown = (model.mid.weight * 2).requires_grad_()  # a non-leaf that requires grad, as torch keeps it
    return model, {"model": model.state_dict(), "param": model.mid.weight, "grown": grown,
                   "transposed": torch.arange(6.0, device=dev).reshape(2, 3).t(), "ids": torch.arange(4, device=dev)}


_LOADER = """
import io, sys, torch
assert "ratex" not in sys.modules
got = torch.load(io.BytesIO(sys.stdin.buffer.read()))  # torch's defaults: weights_only=True, no map_location
sd, param = got["model"], got["param"]
assert all(t.device.type == "cpu" for t in sd.values()), {k: t.device for k, t in sd.items()}
assert type(param) is torch.nn.Parameter and param.requires_grad, type(param)
assert got["grown"].requires_grad and not got["ids"].requires_grad
torch.testing.assert_close(got["transposed"], torch.arange(6.0).reshape(2, 3).t())
torch.testing.assert_close(got["grown"], 2 * param)
torch.testing.assert_close(sd["mid.weight"], param)
assert torch.equal(sd["emb.weight"], sd["head.weight"])
print("ok")
"""


def test_a_checkpoint_saved_from_lazy_loads_with_torch_defaults_where_ratex_is_not_imported(dev):
    import subprocess
    import sys

    _, saved = _lazy_checkpoint(dev)
    run = subprocess.run([sys.executable, "-c", _LOADER], input=_saved(saved), capture_output=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == b"ok", run.stderr.decode()[-2000:]


@pytest.mark.parametrize("where", ["lazy", "lazy:0", torch.device("lazy"), {"cpu": "lazy"}])
def test_map_location_lazy_loads_checkpoints_onto_the_lazy_device(dev, where):
    model, saved = _lazy_checkpoint(dev)
    _, cpu_model = _tied_pair()
    for blob, ref in ((_saved(saved), model), (_saved({"model": cpu_model.state_dict()}), cpu_model)):
        got = torch.load(io.BytesIO(blob), map_location=where)
        assert all(t.device == dev for t in got["model"].values())
        for name, t in ref.state_dict().items():
            torch.testing.assert_close(got["model"][name].cpu(), t.cpu())
    assert isinstance(got := torch.load(io.BytesIO(_saved(saved)), map_location=where)["param"], nn.Parameter)
    assert got.requires_grad and got.device == dev
    fresh = TiedLM().to(dev)
    fresh.load_state_dict(torch.load(io.BytesIO(_saved(saved)), map_location=where)["model"])
    torch.testing.assert_close(fresh.mid.weight.cpu(), model.mid.weight.cpu())
    assert fresh.head.weight is fresh.emb.weight


def test_map_location_with_a_lazy_index_other_than_0_raises(dev):
    _, saved = _lazy_checkpoint(dev)
    with pytest.raises(ValueError, match=r"lazy device index 1 \('lazy:1'\) does not exist"):
        torch.load(io.BytesIO(_saved(saved)), map_location="lazy:1")


def test_scripted_tied_model_trains_like_cpu(dev):
    import ratex

    cpu, model = _tied_pair()
    model.to(dev)
    scripted = ratex.jit.script(model)
    opt, ref = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(cpu.parameters(), lr=0.5)
    torch.manual_seed(2)
    for _ in range(2):
        ids = torch.randint(0, 50, (2, 5))
        for m, o, x in ((cpu, ref, ids), (scripted, opt, ids.to(dev))):
            o.zero_grad()
            _loss(m, x).backward()
            o.step()
        lm.mark_step()
    torch.testing.assert_close(model.emb.weight.cpu(), cpu.emb.weight, rtol=1e-4, atol=1e-5)
    assert model.head.weight is model.emb.weight, "the tied head came apart"


def test_gpt2_with_tied_head_trains_like_cpu(dev):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    cpu = transformers.GPT2LMHeadModel(config)
    model = copy.deepcopy(cpu).to(dev)
    assert model.lm_head.weight is model.transformer.wte.weight, "the tied head came apart"
    opt, ref = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(cpu.parameters(), lr=1e-3)
    torch.manual_seed(3)
    for _ in range(5):
        ids = torch.randint(0, 100, (2, 16))
        ref.zero_grad()
        want = cpu(input_ids=ids, labels=ids).loss
        want.backward()
        ref.step()
        opt.zero_grad()
        got = model(input_ids=ids.to(dev), labels=ids.to(dev)).loss
        got.backward()
        opt.step()
        lm.mark_step()
        torch.testing.assert_close(got.cpu(), want.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model.transformer.wte.weight.cpu(), cpu.transformer.wte.weight, rtol=1e-4, atol=1e-5)


def _lazy_pair(make, x):
    """A torch.nn Lazy* module initialized by a CPU call, and a copy moved to the lazy device before its first call."""
    torch.manual_seed(0)
    cpu, moved = make(), make()
    cpu(x)
    return cpu, moved.to(torch.device("lazy", 0))


@pytest.mark.parametrize("make,shape", [
    (lambda: nn.LazyLinear(3), (4, 5)),
    (lambda: nn.LazyConv2d(4, 3), (2, 3, 6, 6)),
    (lambda: nn.LazyConvTranspose1d(2, 3), (2, 3, 5)),
], ids=["LazyLinear", "LazyConv2d", "LazyConvTranspose1d"])
def test_lazy_module_moved_before_its_first_call_materializes_on_lazy_and_trains_like_cpu(dev, make, shape):
    """As on CUDA, `.to()` keeps a Lazy* module's parameters uninitialized; the first call on lazy
    inputs gives them their shapes on the lazy device and initializes them there."""
    x = torch.randn(shape)
    cpu, model = _lazy_pair(make, x)
    assert isinstance(model.weight, nn.UninitializedParameter) and model.weight.device == dev
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # the same objects become the parameters
    with torch.no_grad():
        model(x.to(dev))
    for (name, p), q in zip(model.named_parameters(), cpu.parameters()):
        assert type(p) is type(cpu.weight.to(dev)) and isinstance(p, nn.Parameter), name
        assert p.device == dev and p.shape == q.shape and p.requires_grad, name
        bound = cpu.weight[0].numel() ** -0.5  # reset_parameters' uniform bound: 1/sqrt(fan_in)
        init = p.detach().cpu()
        assert init.abs().max() <= bound and init.std() > 0, f"{name} is not a uniform draw: {init}"
    with torch.no_grad():  # ratex draws from its own generator: start from CPU's values
        for p, q in zip(model.parameters(), cpu.parameters()):
            p.copy_(q.to(dev))
    ref = torch.optim.SGD(cpu.parameters(), lr=0.1)
    for _ in range(3):
        for m, o, inp in ((cpu, ref, x), (model, opt, x.to(dev))):
            o.zero_grad()
            m(inp).pow(2).mean().backward()
            o.step()
        lm.mark_step()
    for (name, p), q in zip(model.named_parameters(), cpu.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5, msg=name)


def test_lazy_module_initial_values_repeat_under_the_same_seed(dev):
    """The random initialization on the lazy device follows torch.manual_seed, as on CPU."""
    x = torch.randn(2, 5).to(dev)

    def init(seed):
        torch.manual_seed(seed)
        m = nn.LazyLinear(3).to(dev)
        m(x)
        return m.weight.detach().cpu(), m.bias.detach().cpu()

    first, again, other = init(0), init(0), init(1)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert not torch.equal(first[0], other[0])


def test_lazy_batchnorm_buffers_materialize_on_lazy(dev):
    """Uninitialized buffers (LazyBatchNorm's running statistics) move and materialize like parameters."""
    x = torch.randn(6, 3)
    cpu, model = _lazy_pair(lambda: nn.LazyBatchNorm1d(), x[:1].repeat(2, 1))
    cpu.reset_running_stats()
    assert isinstance(model.running_mean, nn.UninitializedBuffer) and model.running_mean.device == dev
    torch.testing.assert_close(model(x.to(dev)).cpu(), cpu(x))
    for name, b in model.named_buffers():
        assert b.device == dev and not isinstance(b, nn.UninitializedBuffer), name
        torch.testing.assert_close(b.cpu(), dict(cpu.named_buffers())[name], msg=name)


def test_uninitialized_lazy_module_on_lazy_loads_a_state_dict(dev):
    """Loading a checkpoint materializes the parameters with the checkpoint's shapes, as on CUDA."""
    ref = nn.Linear(4, 3)
    model = nn.LazyLinear(3).to(dev)
    model.load_state_dict(ref.state_dict())
    assert model.weight.device == dev and not isinstance(model.weight, nn.UninitializedParameter)
    x = torch.randn(2, 4)
    torch.testing.assert_close(model(x.to(dev)).cpu(), ref(x))


def test_uninitialized_lazy_parameters_cast_on_lazy_and_refuse_to_leave_it(dev):
    """A dtype cast keeps them uninitialized (as on CUDA); moving them back to the CPU, where they
    would silently come back initialized and empty, is a clear error."""
    m = nn.LazyLinear(3).to(dev).double()
    assert isinstance(m.weight, nn.UninitializedParameter) and m.weight.dtype == torch.float64
    assert isinstance(copy.deepcopy(m).weight, nn.UninitializedParameter)
    m(torch.randn(2, 4, dtype=torch.float64).to(dev))
    assert m.weight.dtype == torch.float64 and m.weight.shape == (3, 4)
    with pytest.raises(RuntimeError, match="uninitialized parameter of a torch.nn Lazy.*to cpu.*call the module once"):
        nn.LazyLinear(3).to(dev).cpu()


def test_sparse_cpu_tensors_are_refused_by_name(dev):
    """Sparse COO tensors live on the lazy device only as embedding gradients (tests/test_sparse.py):
    moving a sparse CPU tensor there is refused by name, not by a copy error."""
    sparse = torch.sparse_coo_tensor(torch.tensor([[1, 2]]), torch.ones(2, 3), (10, 3))
    with pytest.raises(NotImplementedError, match="sparse_coo.*to_dense"):
        sparse.to(dev)
