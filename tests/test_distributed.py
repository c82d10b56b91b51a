"""Data parallelism through torch.distributed (gloo): two ranks, each on half the batch, train
like one process on the whole batch.

The ranks are two processes of this file (`python tests/test_distributed.py WHAT OUT`),
started once per module; each runs every scenario and saves what it saw, and the tests
compare that with CPU PyTorch training on the whole batch in one process. (A lazy
process on the whole batch would only add compiles: the ranks' programs are checked
against CPU PyTorch directly.)
"""
import datetime
import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tutorials"))
from mnist_models import LeNet5  # noqa: E402

WORLD = 2
STEPS = 5
RTOL, ATOL = 1e-5, 1e-6
TIMEOUT_S = 240  # the launch of both ranks, compiles included; a hang fails the test instead


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _lenet():
    torch.manual_seed(0)
    return LeNet5()


MODELS = {"mlp": (_mlp, (8,)), "lenet": (_lenet, (1, 28, 28))}


def _batches(model: str, n=STEPS, batch=4):
    shape = MODELS[model][1]
    g = torch.Generator().manual_seed(1)
    return [(torch.randn((batch,) + shape, generator=g), torch.randint(0, 4, (batch,), generator=g)) for _ in range(n)]


OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), "adam": (torch.optim.Adam, {"lr": 0.01})}


def _state_numel(opt) -> int:
    """Elements of tensor state (Adam's moments) that `opt` holds in this process."""
    return sum(v.numel() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def train(model_name, opt_name, mode, dev, rank=0, world=1):
    """Train STEPS steps on this rank's share of each batch; return losses (averaged over ranks),
    final parameters (CPU) and the elements of optimizer state this process holds."""
    import ratex.lazy_tensor_core.core.lazy_model as lm

    model = MODELS[model_name][0]().to(dev)
    net = model
    if mode == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
    if mode == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        cls, kwargs = OPTIMIZERS[opt_name]
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, **kwargs)
    else:
        cls, kwargs = OPTIMIZERS[opt_name]
        opt = cls(model.parameters(), **kwargs)
    losses = []
    for x, y in _batches(model_name):
        share = x.shape[0] // world
        x, y = x[rank * share:(rank + 1) * share].to(dev), y[rank * share:(rank + 1) * share].to(dev)
        opt.zero_grad()
        loss = F.nll_loss(F.log_softmax(net(x), 1), y) if model_name == "mlp" else F.nll_loss(net(x), y)
        loss.backward()
        if mode == "ddp":
            opt.step()
        elif mode == "zero":
            lm.reduce_gradients(opt)
            opt.step()
        else:
            lm.optimizer_step(opt)
        lm.mark_step()
        if world > 1:
            loss = lm.all_reduce(lm.REDUCE_SUM, loss, scale=1.0 / world)
        losses.append(loss.item())
    local = opt.optim if mode == "zero" else opt
    return losses, [p.detach().cpu() for p in model.parameters()], _state_numel(local)


# (model, optimizer, how the ranks average gradients, ENABLE_PARAM_ALIASING); LeNet-5 once (its
# compiles dominate the module's time), the MLP under each way and with buffer donation.
SCENARIOS = [("lenet", "sgd", "lm", False)] + [
    (model, opt, mode, aliasing) for aliasing in (False, True)
    for model, opt, mode in (("mlp", "sgd", "lm"), ("mlp", "adam", "zero"), ("mlp", "sgd", "ddp"))
]


def collectives(rank, dev):
    """lm's collectives and torch.distributed's own calls on lazy tensors; return the results on CPU."""
    import torch.distributed as dist
    import ratex.lazy_tensor_core.core.lazy_model as lm

    out = {}
    a = torch.tensor([1.0, 2.0, 3.0]).to(dev) * (rank + 1)  # pending: computed before the collective
    out["sum"] = lm.all_reduce(lm.REDUCE_SUM, a, scale=0.5).cpu()
    out["a"] = a.cpu()  # a single tensor is not reduced in place
    out["max"] = lm.all_reduce(lm.REDUCE_MAX, a).cpu()
    b, c = torch.full((2, 2), float(rank)).to(dev), torch.tensor([rank + 1, 10]).to(dev)
    lm.all_reduce(lm.REDUCE_SUM, [b, c])  # a list is reduced in place, one bucket per dtype
    out["b"], out["c"] = b.cpu(), c.cpu()
    out["gather"] = lm.all_gather(torch.full((2, 3), float(rank)).to(dev), dim=1).cpu()
    x = (torch.arange(8.0).reshape(4, 2) + rank).to(dev)
    out["scatter"] = lm.reduce_scatter(lm.REDUCE_SUM, x, scale=1.0, scatter_dim=0).cpu()
    y = torch.ones(4).to(dev) * (rank + 1)
    base = torch.zeros(4).to(dev)
    view = base[1:3]
    view.add_(rank + 1)
    dist.all_reduce(y)
    dist.all_reduce(view)  # through a view: its base sees the sum
    out["dist_y"], out["dist_base"] = y.cpu(), base.cpu()
    w = torch.full((3,), float(rank)).to(dev)
    dist.broadcast(w, src=1)
    out["broadcast"] = w.cpu()
    parts = [torch.empty(2).to(dev) for _ in range(WORLD)]
    dist.all_gather(parts, torch.full((2,), float(rank + 5)).to(dev))
    out["dist_gather"] = torch.stack([p.cpu() for p in parts])
    return out


def _worker(what: str, out: str):
    """One rank: run `what` ('train', or 'fail' where rank 1 raises), save results to OUT.rank."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
    import ratex  # noqa: F401
    import ratex.lazy_tensor_core.core.lazy_model as lm
    from ratex import config

    dev = lm.lazy_device()
    if what == "fail":
        if rank == 1:
            raise RuntimeError("rank 1 fails on purpose")
        x = torch.ones(4).to(dev) * 2  # pending: the all-reduce computes it first
        lm.all_reduce(lm.REDUCE_SUM, [x])
        return
    results = {"collectives": collectives(rank, dev)}
    for scenario in SCENARIOS:
        config.PARAM_ALIASING = scenario[3]
        results[scenario] = train(*scenario[:3], dev, rank, WORLD)
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


def _start(what: str, out: pathlib.Path) -> list:
    """Start WORLD ranks of this file running `what`; return their processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), RATEX_NUM_THREADS="1", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, what, str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _wait(procs, what: str) -> list:
    """(returncode, stderr) of each rank; fails the test if one runs past TIMEOUT_S (never hangs)."""
    results = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
                q.communicate()
            pytest.fail(f"a rank of '{what}' ran past {TIMEOUT_S} s")
        results.append((p.returncode, err))
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each rank saw, per scenario."""
    out = tmp_path_factory.mktemp("dist") / "results"
    for code, err in _wait(_start("train", out), "train"):
        assert code == 0, err[-3000:]
    return [torch.load(f"{out}.{r}") for r in range(WORLD)]


def _whole_batch(model, opt):
    """CPU PyTorch, one process, the whole batch: losses, parameters, elements of optimizer state."""
    return train(model, opt, "lm", torch.device("cpu"))


@pytest.mark.parametrize("scenario", SCENARIOS, ids=["-".join(s[:3]) + ("-aliasing" if s[3] else "") for s in SCENARIOS])
def test_two_ranks_train_like_one_process(ranks, scenario):
    model, opt, mode, aliasing = scenario
    ref_losses, ref_params, _ = _whole_batch(model, opt)
    for rank in ranks:
        losses, params, _ = rank[scenario]
        torch.testing.assert_close(losses, ref_losses, rtol=RTOL, atol=ATOL)
        for p, r in zip(params, ref_params):
            torch.testing.assert_close(p, r, rtol=RTOL, atol=ATOL)
    # every rank ends with the very same parameters, not only close ones
    for a, b in zip(ranks[0][scenario][1], ranks[1][scenario][1]):
        assert torch.equal(a, b)


def test_collectives(ranks):
    for rank, seen in enumerate(r["collectives"] for r in ranks):
        expect = {
            "sum": torch.tensor([1.5, 3.0, 4.5]),
            "a": torch.tensor([1.0, 2.0, 3.0]) * (rank + 1),
            "max": torch.tensor([2.0, 4.0, 6.0]),
            "b": torch.full((2, 2), 1.0),
            "c": torch.tensor([3, 20]),
            "gather": torch.cat([torch.zeros(2, 3), torch.ones(2, 3)], 1),
            "scatter": (2 * torch.arange(8.0).reshape(4, 2) + 1)[2 * rank:2 * rank + 2],
            "dist_y": torch.full((4,), 3.0),
            "dist_base": torch.tensor([0.0, 3.0, 3.0, 0.0]),
            "broadcast": torch.ones(3),
            "dist_gather": torch.tensor([[5.0, 5.0], [6.0, 6.0]]),
        }
        assert set(seen) == set(expect)
        for name, value in expect.items():
            torch.testing.assert_close(seen[name], value, rtol=0, atol=0, msg=f"{name} on rank {rank}")


@pytest.mark.parametrize("aliasing", [False, True], ids=["", "aliasing"])
def test_zero_shards_the_adam_state(ranks, aliasing):
    whole = _whole_batch("mlp", "adam")[2]
    held = [rank["mlp", "adam", "zero", aliasing][2] for rank in ranks]
    assert sum(held) == whole  # every moment is held once, by one rank
    for h in held:
        assert 0.3 * whole <= h <= 0.7 * whole, f"a rank holds {h} of {whole} state elements"


def test_without_a_process_group(dev, monkeypatch):
    """One process: the step needs no all-reduce; a process torchrun started as one of several raises."""
    import ratex.lazy_tensor_core.core.lazy_model as lm

    model = torch.nn.Linear(3, 2).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 3).to(dev)).sum().backward()
    before = [p.grad.cpu() for p in model.parameters()]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    lm.reduce_gradients(opt)
    for p, g in zip(model.parameters(), before):
        assert torch.equal(p.grad.cpu(), g)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="init_process_group"):
        lm.optimizer_step(opt)
    with pytest.raises(RuntimeError, match="init_process_group"):
        lm.all_reduce(lm.REDUCE_SUM, model.weight)


def test_bad_arguments_are_named():
    from ratex import distributed

    with pytest.raises(ValueError, match="reduce_type='avg'"):
        distributed._reduce_op("avg")
    with pytest.raises(TypeError, match="lazy tensors; got a tensor on cpu"):
        distributed._check_lazy([torch.ones(2)], "all_reduce")


def test_a_failing_rank_fails_the_others(tmp_path):
    results = _wait(_start("fail", tmp_path / "results"), "fail")
    assert results[1][0] != 0 and "rank 1 fails on purpose" in results[1][1]
    code, err = results[0]
    assert code != 0, "rank 0 finished although rank 1 never joined its collectives"
    assert "another rank failed or stopped calling collectives" in err and "Connection closed" in err, err[-3000:]


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
