"""Data-parallel training of LeNet-5 on the lazy device, one process per rank.

    torchrun --nproc_per_node=2 tutorials/ddp.py [--mode lm|ddp|zero] [--steps N] [--batch-size B]

Each rank trains on its share of every batch and the gradients are averaged
across ranks, so every rank holds the same parameters after every step:

  lm    lm.optimizer_step(optimizer): forward+backward is one program, the
        gradients are all-reduced in flat buckets, the update is a second program;
  ddp   torch.nn.parallel.DistributedDataParallel wrapping the lazy module (its
        reducer all-reduces DDP's buckets during backward);
  zero  torch.distributed.optim.ZeroRedundancyOptimizer: each rank keeps the Adam
        state of its shard of the parameters only.

The process group is torch.distributed's: gloo on CPU; with RATEX_DEVICE=GPU, NCCL.
"""
import argparse
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer

import ratex  # noqa: F401  (makes the lazy device real)
import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex import config, datasets

from mnist_models import LeNet5  # tutorials/mnist_models.py


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("lm", "ddp", "zero"), default="lm")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="the global batch, split across ranks")
    args = parser.parse_args(argv)

    backend = "nccl" if config.DEVICE == "GPU" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the {world} ranks")

    torch.manual_seed(0)  # the same initial parameters on every rank
    device = lm.lazy_device()
    model = LeNet5().to(device)
    net = torch.nn.parallel.DistributedDataParallel(model) if args.mode == "ddp" else model
    if args.mode == "zero":
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    images, labels = datasets.synthetic_mnist(args.steps * args.batch_size)
    share = args.batch_size // world
    for step, (x, y) in enumerate(datasets.batches(images, labels, args.batch_size)):
        x, y = x[rank * share:(rank + 1) * share].to(device), y[rank * share:(rank + 1) * share].to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = F.nll_loss(net(x), y)
        loss.backward()
        if args.mode == "ddp":
            optimizer.step()  # DDP averaged the gradients during backward
        elif args.mode == "zero":
            lm.reduce_gradients(optimizer)
            optimizer.step()  # this rank's shard, then every rank broadcasts its shard
        else:
            lm.optimizer_step(optimizer)
        lm.mark_step()
        mean = lm.all_reduce(lm.REDUCE_SUM, loss.detach(), scale=1.0 / world)
        if rank == 0:
            print(f"step {step}  loss {mean.item():.6f}")

    checksum = torch.stack([p.detach().cpu().double().sum() for p in model.parameters()]).sum()
    sums = [torch.zeros((), dtype=torch.float64) for _ in range(world)]
    dist.all_gather_object(sums, checksum)
    if rank == 0:
        same = all(torch.equal(s, sums[0]) for s in sums)
        print(f"{world} ranks, mode {args.mode}, backend {backend}: parameters identical on every rank: {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
