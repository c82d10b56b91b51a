"""The GPU path: the CUDA program for a training step builds on any machine (nvcc is enough);
running it needs a GPU, so those tests skip where TVM sees none."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import tvm

import ratex.lazy_tensor_core.core.lazy_model as lm
import tvm_lowering
from ratex.core import graph, sync

from models import LeNet5

HAS_GPU = tvm.cuda(0).exist


def test_lenet_training_step_builds_for_cuda(dev):
    model = LeNet5().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss = F.nll_loss(model(torch.randn(2, 1, 28, 28).to(dev)), torch.tensor([1, 2]).to(dev))
    loss.backward()
    opt.step()
    roots = [st.value for st in sync.pending_storages()]
    step = graph.cut(roots)
    ops = {n.op.__name__ for n in step.nodes}
    assert {"convolution.default", "convolution_backward.default", "add.Tensor"} <= ops  # fwd, bwd and update
    mod = tvm_lowering.import_graph(graph.to_fx(step), library=False)
    executable = tvm_lowering.build(mod, tvm_lowering.resolve_target("GPU", "sm_90"))
    assert "main" in executable.as_text()
    lm.mark_step()  # leave nothing pending for other tests


def test_gpu_without_cuda_fails_at_first_lazy_op():
    if HAS_GPU:
        pytest.skip("a CUDA device is present")
    env = dict(os.environ, RATEX_DEVICE="GPU", RATEX_CACHE_DIR="")
    code = "import torch, ratex\ntorch.ones(2).to('lazy') + 1"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "RATEX_DEVICE=GPU but no CUDA device" in proc.stderr


@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU visible to TVM")
def test_gpu_lenet_training_matches_cpu():
    env = dict(os.environ, RATEX_DEVICE="GPU")
    script = os.path.join(os.path.dirname(__file__), "..", "tutorials", "lenet.py")
    proc = subprocess.run([sys.executable, script, "--epochs", "2"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Epoch 1/1" in proc.stdout or "Epoch 1/" in proc.stdout
