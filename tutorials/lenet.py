"""Train LeNet-5 on the lazy device with `ratex.jit.script`.

    ENABLE_PARAM_ALIASING=true RATEX_DEVICE=CPU python tutorials/lenet.py

`ratex.jit.script(model)` traces the model's forward once, converts it to a
TVM Relax function and differentiates it inside TVM; every training step
(forward, loss, backward, SGD update) then runs as one compiled program at
`lm.mark_step()`. The data is a small synthetic stand-in for MNIST (28x28
grayscale images of 10 classes), generated here so nothing is downloaded.
With the classic lr=0.001 the loss creeps down; `--lr 0.05` shows it learn
(about 2.30 -> 1.45 in 10 epochs). `--samples`, `--batch-size` and
`--epochs` size the run.
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import ratex
import ratex.lazy_tensor_core.core.lazy_model as lm


class LeNet5(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(6, 16, kernel_size=5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return F.log_softmax(self.fc3(x), dim=1)


def synthetic_mnist(num_samples, seed=0):
    """Deterministic MNIST-like data: each class is a blurred random stroke pattern,
    drawn with a random shift, random contrast and pixel noise."""
    g = torch.Generator().manual_seed(seed)
    templates = (torch.rand(10, 1, 14, 14, generator=g) > 0.7).float()
    templates = F.interpolate(templates, size=(20, 20), mode="bilinear", align_corners=False)
    templates = F.avg_pool2d(templates, 3, stride=1, padding=1)
    labels = torch.randint(0, 10, (num_samples,), generator=g)
    images = torch.zeros(num_samples, 1, 28, 28)
    shifts = torch.randint(0, 9, (num_samples, 2), generator=g)
    contrast = 0.7 + 0.6 * torch.rand(num_samples, generator=g)
    for i in range(num_samples):
        dy, dx = shifts[i].tolist()
        images[i, :, dy : dy + 20, dx : dx + 20] = templates[labels[i]] * contrast[i]
    images += 0.3 * torch.randn(images.shape, generator=g)
    images = (images - 0.1307) / 0.3081  # the usual MNIST normalization
    return images, labels


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--samples", type=int, default=512, help="training images per epoch")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.001)
    args = parser.parse_args()

    torch.manual_seed(0)
    images, labels = synthetic_mnist(args.samples)
    batches = [
        (images[i : i + args.batch_size], labels[i : i + args.batch_size])
        for i in range(0, args.samples - args.batch_size + 1, args.batch_size)  # full batches: one shape
    ]

    device = lm.lazy_device()
    model = LeNet5()
    model = ratex.jit.script(model)
    model.to(device)
    model.train()
    optimizer = optim.SGD(model.parameters(), lr=args.lr)

    start = time.time()
    for epoch in range(args.epochs):
        total = 0.0
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = F.nll_loss(model(x), y)
            loss.backward()
            optimizer.step()
            lm.mark_step()
            total += loss.item()
        print(f"Epoch {epoch}/{args.epochs - 1} loss: {total / len(batches):.4f}")
    print(f"{args.epochs} epochs in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
