"""Train a small CNN on the plain lazy device (no jit.script): every op is recorded,
and each `mark_step()` compiles (once) and runs forward, backward and the SGD update.

    python tutorials/cnn_lazy.py [--data DIR] [--steps N] [--batch-size B]
"""
import argparse

import torch
import torch.nn.functional as F
from torch import nn

import ratex
import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex import datasets
from ratex.lazy_tensor_core.debug import metrics


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 7 * 7, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return F.log_softmax(self.fc(torch.flatten(x, 1)), dim=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", help="directory with MNIST IDX files (synthetic data if omitted)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    torch.manual_seed(0)
    if args.data:
        images, labels = datasets.mnist(args.data)
    else:
        images, labels = datasets.synthetic_mnist(args.steps * args.batch_size)
    device = lm.lazy_device()
    model = CNN().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for step, (x, y) in enumerate(datasets.batches(images, labels, args.batch_size)):
        if step == args.steps:
            break
        optimizer.zero_grad()
        loss = F.nll_loss(model(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        lm.mark_step()
        print(f"step {step:3d} loss: {loss.item():.4f}")
    print(metrics.counter_names())
    assert ratex.is_lazy(model.fc.weight)


if __name__ == "__main__":
    main()
