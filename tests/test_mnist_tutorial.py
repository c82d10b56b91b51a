"""The MNIST tutorial: without dropout it matches CPU step by step; with dropout its loss goes down,
and ratex.jit.script of its Net (dropout included) trains exactly like the plain lazy device."""
import copy
import importlib.util
import pathlib
import sys
import warnings

import torch

from ratex import datasets, jit
from ratex.lazy_tensor_core.debug import metrics

_TUTORIALS = pathlib.Path(__file__).parent.parent / "tutorials"
sys.path.insert(0, str(_TUTORIALS))  # the tutorial imports its model as when it runs as a script
_spec = importlib.util.spec_from_file_location("mnist_tutorial", _TUTORIALS / "mnist.py")
mnist = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mnist)


def _run(model, device, batches):
    model = model.to(device)  # before the optimizer, as PyTorch's docs ask for any device
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    losses = []
    mnist.train(10**9, model, device, batches, optimizer, 1, losses)
    return [float(loss.detach()) for loss in losses]


def test_matches_cpu_without_dropout(dev):
    torch.manual_seed(0)
    images, labels = datasets.synthetic_mnist(5 * 8)
    batches = list(datasets.batches(images, labels, 8))
    model = mnist.MnistNet(dropout=False)
    want = _run(copy.deepcopy(model), torch.device("cpu"), batches)
    got = _run(model, dev, batches)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_loss_goes_down_with_dropout_scripted_or_not(dev):
    torch.manual_seed(0)
    images, labels = datasets.synthetic_mnist(16 * 8)
    batches = list(datasets.batches(images, labels, 8))
    net = mnist.MnistNet()
    torch.manual_seed(1)  # each run draws its dropout seeds from here on
    losses = _run(copy.deepcopy(net), dev, batches)
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3, losses
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="ratex.jit.script")  # no fallback to the plain path
        scripted = _run(jit.script(net), dev, batches[:4])
    assert metrics.counter_value("ratex::script_bwd.default") == 4
    torch.testing.assert_close(scripted, losses[:4], rtol=1e-4, atol=1e-4)  # the same dropout masks
