"""The PyTorch Lazy Tensor Core tutorial's MNIST training, on ratex's lazy device.

    python tutorials/mnist.py [--data DIR] [--epochs N] [--batch-size B] [--limit-batches K]

Reads MNIST IDX files from --data when given (train-images-idx3-ubyte[.gz] and
train-labels-idx1-ubyte[.gz]); otherwise trains on a synthetic stand-in with
MNIST's shapes. As in the tutorial: Adadelta(lr=1), StepLR(gamma=0.7),
mark_step() after every optimizer step, the loss printed every log interval,
and the metrics' counter names at the end.
"""
import argparse

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import StepLR

import ratex  # noqa: F401  (makes the lazy device real)
import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex import datasets
from ratex.lazy_tensor_core.debug import metrics

from mnist_models import MnistNet  # tutorials/mnist_models.py


def train(log_interval, model, device, batches, optimizer, epoch, losses=None):
    model.train()
    for batch_idx, (data, target) in enumerate(batches):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad(set_to_none=True)
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        lm.mark_step()
        if losses is not None:
            losses.append(loss)
        if batch_idx % log_interval == 0:
            print(f"Train Epoch: {epoch} [{batch_idx}]\tLoss: {loss.item():.6f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", help="directory with MNIST IDX files (synthetic data if omitted)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--limit-batches", type=int, default=20, help="batches per epoch (0: all)")
    parser.add_argument("--log-interval", type=int, default=5)
    args = parser.parse_args(argv)

    torch.manual_seed(1)
    device = lm.lazy_device()
    if args.data:
        images, labels = datasets.mnist(args.data)
    else:
        images, labels = datasets.synthetic_mnist(max(args.limit_batches, 1) * args.batch_size)
    model = MnistNet().to(device)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
    for epoch in range(1, args.epochs + 1):
        batches = list(datasets.batches(images, labels, args.batch_size))
        if args.limit_batches:
            batches = batches[: args.limit_batches]
        train(args.log_interval, model, device, batches, optimizer, epoch)
        scheduler.step()
    print(metrics.counter_names())


if __name__ == "__main__":
    main()
