"""Data parallelism through torch.distributed (gloo): two ranks, each on half the batch, train
like one process on the whole batch.

The ranks are two processes of this file (`python tests/test_distributed.py SCENARIO OUT`),
started once per module; each runs every scenario and saves what it saw, and the tests
compare that with one process training on the whole batch.
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
        train("mlp", "sgd", "lm", dev, rank, WORLD)
        return
    results = {}
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
def runs(tmp_path_factory):
    """What each rank saw, and one process on the whole batch per (model, optimizer, aliasing),
    trained here while the ranks run."""
    from ratex import config
    import ratex.lazy_tensor_core.core.lazy_model as lm

    out = tmp_path_factory.mktemp("dist") / "results"
    procs = _start("train", out)
    single, saved = {}, config.PARAM_ALIASING
    try:
        for model, opt, _, aliasing in SCENARIOS:
            if (model, opt, aliasing) not in single:
                config.PARAM_ALIASING = aliasing
                single[model, opt, aliasing] = train(model, opt, "lm", lm.lazy_device())
    finally:
        config.PARAM_ALIASING = saved
        results = _wait(procs, "train")
    for code, err in results:
        assert code == 0, err[-3000:]
    return [torch.load(f"{out}.{r}") for r in range(WORLD)], single


@pytest.mark.parametrize("scenario", SCENARIOS, ids=["-".join(s[:3]) + ("-aliasing" if s[3] else "") for s in SCENARIOS])
def test_two_ranks_train_like_one_process(runs, scenario):
    ranks, single = runs
    model, opt, mode, aliasing = scenario
    ref_losses, ref_params, _ = single[model, opt, aliasing]
    for rank in ranks:
        losses, params, _ = rank[scenario]
        torch.testing.assert_close(losses, ref_losses, rtol=RTOL, atol=ATOL)
        for p, r in zip(params, ref_params):
            torch.testing.assert_close(p, r, rtol=RTOL, atol=ATOL)
    # every rank ends with the very same parameters, not only close ones
    for a, b in zip(ranks[0][scenario][1], ranks[1][scenario][1]):
        assert torch.equal(a, b)


def test_single_process_matches_cpu(runs):
    """The reference itself: one lazy process trains as CPU PyTorch does."""
    for (model, opt, _), (losses, params, _) in runs[1].items():
        cpu_losses, cpu_params, _ = train(model, opt, "lm", torch.device("cpu"))
        torch.testing.assert_close(losses, cpu_losses, rtol=1e-4, atol=1e-5)
        for p, r in zip(params, cpu_params):
            torch.testing.assert_close(p, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("aliasing", [False, True], ids=["", "aliasing"])
def test_zero_shards_the_adam_state(runs, aliasing):
    ranks, single = runs
    whole = single["mlp", "adam", aliasing][2]
    held = [rank["mlp", "adam", "zero", aliasing][2] for rank in ranks]
    assert sum(held) == whole  # every moment is held once, by one rank
    for h in held:
        assert 0.3 * whole <= h <= 0.7 * whole, f"a rank holds {h} of {whole} state elements"


def test_a_failing_rank_fails_the_others(tmp_path):
    results = _wait(_start("fail", tmp_path / "results"), "fail")
    assert results[1][0] != 0 and "rank 1 fails on purpose" in results[1][1]
    code, err = results[0]
    assert code != 0, "rank 0 finished although rank 1 never joined its collectives"
    assert "another rank failed or stopped calling collectives" in err, err[-3000:]


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
