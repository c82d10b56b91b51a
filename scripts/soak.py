"""Soak test: train LeNet-5 on the lazy device for many steps and print resident memory.

    python scripts/soak.py [--steps 2000] [--script] [--batch-size 16]

Lazy IR nodes and device buffers must be freed once nothing refers to them,
so resident memory stays flat across thousands of steps. Prints RSS at a few
steps and the growth between step 100 and the last step.
"""
import argparse
import os
import time

import torch
import torch.nn.functional as F

import ratex
import ratex.lazy_tensor_core.core.lazy_model as lm
from bench_models import LeNet5  # scripts/ is on sys.path when run as a script


def rss_mb() -> float:
    """Resident set size of this process in MiB (Linux /proc)."""
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--script", action="store_true", help="use ratex.jit.script")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = lm.lazy_device()
    model = LeNet5()
    if args.script:
        model = ratex.jit.script(model)
    model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(args.batch_size, 1, 28, 28), torch.randint(0, 10, (args.batch_size,))
    marks, start = {}, time.perf_counter()
    for step in range(1, args.steps + 1):
        opt.zero_grad()
        loss = F.nll_loss(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        lm.mark_step()
        if step in (10, 100, 500, 1000) or step == args.steps:
            lm.wait_device_ops()
            marks[step] = rss_mb()
            print(f"step {step:5d}  rss {marks[step]:8.1f} MiB  loss {loss.item():.4f}  {time.perf_counter() - start:6.1f} s")
    if 100 in marks:
        growth = (marks[args.steps] - marks[100]) / marks[100] * 100
        print(f"RSS growth from step 100 to step {args.steps}: {growth:+.2f}%")


if __name__ == "__main__":
    main()
