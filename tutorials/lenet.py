"""Train LeNet-5 on the lazy device with `ratex.jit.script`.

    ENABLE_PARAM_ALIASING=true RATEX_DEVICE=CPU python tutorials/lenet.py

`ratex.jit.script(model)` traces the model's forward once, converts it to a
TVM Relax function and differentiates it inside TVM; every training step
(forward, loss, backward, SGD update) then runs as one compiled program at
`lm.mark_step()`. The data is MNIST from IDX files with `--data DIR`, else a
synthetic stand-in of the same shapes (ratex.datasets), so nothing is downloaded.
With the classic lr=0.001 the loss creeps down; `--lr 0.05` shows it learn
faster. `--samples`, `--batch-size` and `--epochs` size the run. The loss is
summed on the device and read once per epoch, so steps never wait for each
other: step N+1 is traced while step N runs.
"""
import argparse
import time

import torch
import torch.nn.functional as F
import torch.optim as optim

import ratex
import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex import datasets

from mnist_models import LeNet5  # tutorials/mnist_models.py


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="directory with MNIST IDX files (synthetic data if omitted)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--samples", type=int, default=512, help="training images per epoch")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.001)
    args = parser.parse_args()

    torch.manual_seed(0)
    images, labels = datasets.mnist(args.data) if args.data else datasets.synthetic_mnist(args.samples)
    images, labels = images[: args.samples], labels[: args.samples]
    batches = list(datasets.batches(images, labels, args.batch_size))  # full batches: one shape, one program

    device = lm.lazy_device()
    model = LeNet5()
    model = ratex.jit.script(model)
    model.to(device)
    model.train()
    optimizer = optim.SGD(model.parameters(), lr=args.lr)

    start = time.time()
    for epoch in range(args.epochs):
        total = torch.zeros((), device=device)  # summed on the device: no sync inside the epoch
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = F.nll_loss(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.detach()  # before mark_step: part of this step's program
            lm.mark_step()
        print(f"Epoch {epoch}/{args.epochs - 1} loss: {total.item() / len(batches):.4f}")
    print(f"{args.epochs} epochs in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
