"""Kernel library dispatch: heavy Relax ops become ratex.lib.* calls and compute what TVM's code computes."""
import numpy as np
import pytest
import tvm
from tvm import relax

import ratex  # noqa: F401  (registers ratex.lib.*)
from tvm_lowering import Options, build, resolve_target
from tvm_lowering.library_dispatch import library_dispatch


def _module():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 3, 9, 9), "float32"))
    w = relax.Var("w", relax.TensorType((4, 3, 3, 3), "float32"))
    wt = relax.Var("wt", relax.TensorType((4, 2, 3, 3), "float32"))
    m = relax.Var("m", relax.TensorType((5, 7), "float32"))
    dy = relax.Var("dy", relax.TensorType((2, 4, 5, 5), "float32"))
    dp = relax.Var("dp", relax.TensorType((2, 3, 5, 5), "float32"))
    b = relax.Var("b", relax.TensorType((2, 4, 3), "float32"))
    with bb.function("main", [x, w, wt, m, dy, dp, b]):
        with bb.dataflow():
            c = bb.emit(relax.op.nn.conv2d(x, w, strides=[2, 2], padding=[1, 0, 1, 2], dilation=[1, 1]))
            t = bb.emit(relax.op.nn.conv2d_transpose(c, wt, strides=[2, 2], padding=[1, 1, 1, 1], output_padding=[1, 1]))
            mm = bb.emit(relax.op.matmul(m, relax.op.permute_dims(m)))
            bmm = bb.emit(relax.op.matmul(relax.op.permute_dims(b, [0, 2, 1]), b))  # batched, first operand swapped
            # what relax Gradient emits for the weight of conv2d(x, w, stride 2, padding 1) ...
            gw = bb.emit(relax.op.nn.conv2d(
                x, dy, strides=[1, 1], padding=[1, 1, 1, 1], dilation=[2, 2],
                data_layout="CNHW", kernel_layout="IOHW", out_layout="CNHW",
            ))
            # ... and for pooling: overlapping windows, padding, ceil_mode
            gmax = bb.emit(relax.op.grad.max_pool2d_backward(dp, x, [3, 3], [2, 2], [1, 1, 1, 1], [1, 1], ceil_mode=True))
            gavg = bb.emit(relax.op.grad.avg_pool2d_backward(
                dp, x, [3, 3], [2, 2], [1, 1, 1, 1], [1, 1], ceil_mode=True, count_include_pad=False,
            ))
            out = bb.emit_output(relax.Tuple([c, t, mm, bmm, gw, gmax, gavg]))
        bb.emit_func_output(out)
    return bb.get()


def _run(library):
    mod = _module()
    rng = np.random.default_rng(0)
    args = [
        tvm.runtime.tensor(rng.standard_normal(s).astype("float32"))
        for s in [(2, 3, 9, 9), (4, 3, 3, 3), (4, 2, 3, 3), (5, 7), (2, 4, 5, 5), (2, 3, 5, 5), (2, 4, 3)]
    ]
    vm = relax.VirtualMachine(build(mod, resolve_target("CPU"), Options(library=library)), tvm.cpu())
    return [o.numpy() for o in vm["main"](*args)]


def test_pass_rewrites_heavy_ops():
    mod = tvm.transform.Sequential([library_dispatch, relax.transform.DeadCodeElimination()])(_module())
    text = mod.script()
    for name in ("conv2d", "conv2d_transpose", "matmul_out", "conv2d_weight_grad", "max_pool2d_backward",
                 "avg_pool2d_backward"):
        assert f'"ratex.lib.{name}"' in text
    assert "R.nn.conv2d(" not in text and "R.grad." not in text
    # matmul operands swapped in their last two axes are passed as they are, with a flag: no transposed copy
    assert "R.permute_dims" not in text and text.count('\\"ta\\": true') == 1 and text.count('\\"tb\\": true') == 1


def test_auto_keeps_small_products_as_tvm_code():
    """With a threshold (RATEX_KERNELS=auto), the module's small convs and matmuls (at most
    ~1.3k multiply-adds) stay TVM ops and the pooling gradients still go to the library;
    a threshold the products reach sends them too."""
    from tvm_lowering.library_dispatch import AUTO_MIN_MACS, library_dispatch_pass

    text = library_dispatch_pass(AUTO_MIN_MACS)(_module()).script()
    for name in ("conv2d", "conv2d_transpose", "matmul_out", "conv2d_weight_grad"):
        assert f'"ratex.lib.{name}"' not in text, name
    assert '"ratex.lib.max_pool2d_backward"' in text and '"ratex.lib.avg_pool2d_backward"' in text
    assert "R.nn.conv2d(" in text and "R.nn.conv2d_transpose(" in text and "R.matmul(" in text
    text = library_dispatch_pass(100)(_module()).script()
    for name in ("conv2d", "conv2d_transpose", "matmul_out", "conv2d_weight_grad"):
        assert f'"ratex.lib.{name}"' in text, name


def test_library_matches_tvm_generated_code():
    for got, want in zip(_run(library=True), _run(library=False)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_consecutive_transposes_fold_into_one_or_none():
    from tvm_lowering.simplify import fold_transposes

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 3, 4), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.permute_dims(x, [1, 0, 2]))
            same = bb.emit(relax.op.permute_dims(a, [1, 0, 2]))  # cancels
            other = bb.emit(relax.op.permute_dims(a, [2, 0, 1]))  # composes
            rev = bb.emit(relax.op.permute_dims(bb.emit(relax.op.permute_dims(x)), [0, 2, 1]))  # axes=None first
            out = bb.emit_output(relax.Tuple([same, other, rev]))
        bb.emit_func_output(out)
    mod = bb.get()
    folded = tvm.transform.Sequential([fold_transposes, relax.transform.DeadCodeElimination()])(mod)
    assert folded.script().count("R.permute_dims") == 2  # one per non-identity chain
    data = np.random.default_rng(0).standard_normal((2, 3, 4)).astype("float32")
    got = relax.VirtualMachine(build(folded, resolve_target("CPU")), tvm.cpu())["main"](tvm.runtime.tensor(data))
    want = [data, data.transpose(1, 0, 2).transpose(2, 0, 1), data.transpose(2, 1, 0).transpose(0, 2, 1)]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.numpy(), w)


@pytest.mark.cpu_only("the CPU target's threshold under RATEX_KERNELS=auto")
def test_auto_sends_only_large_aten_products_to_the_library(tmp_path, monkeypatch):
    """On the lazy path under RATEX_KERNELS=auto, LeNet-5-at-batch-1-sized convs and matmuls are
    TVM code (results as CPU PyTorch's), a 2M multiply-add matmul calls PyTorch's kernel."""
    import torch
    import torch.nn.functional as F

    import ratex.lazy_tensor_core.core.lazy_model as lm
    from ratex import config
    from ratex.core import sync

    ir = tmp_path / "ir.txt"
    monkeypatch.setattr(config, "SAVE_IR", str(ir))
    monkeypatch.setattr(config, "KERNELS", "AUTO")
    sync.reset_cache()
    g = torch.Generator().manual_seed(0)
    x, w, a, b = (torch.randn(*s, generator=g) for s in [(1, 3, 14, 14), (16, 3, 5, 5), (8, 120), (120, 84)])
    w.requires_grad_(True)
    dev = lm.lazy_device()
    wl = w.detach().to(dev).requires_grad_(True)
    out = F.conv2d(x.to(dev), wl, padding=2)
    out.square().sum().backward()
    got = [out.cpu(), wl.grad.cpu(), torch.mm(a.to(dev), b.to(dev)).cpu()]
    ref = F.conv2d(x, w, padding=2)
    ref.square().sum().backward()
    for have, want in zip(got, [ref, w.grad, a @ b]):
        torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-4)
    assert "ratex.lib." not in ir.read_text()
    ir.unlink()
    big = torch.randn(128, 128, generator=g)
    torch.testing.assert_close(torch.mm(big.to(dev), big.to(dev)).cpu(), big @ big, rtol=1e-4, atol=1e-4)
    assert '"ratex.lib.mm_out"' in ir.read_text()
    sync.reset_cache()


def test_max_pool_gradients_over_tiling_windows_are_a_tvm_gather():
    """A 2x2/stride-2 pool's gradient stays TVM code (the window winners, then a select per
    element, pool_grad.py); overlapping, padded, leftover or 3x3 windows go to the library."""
    from tvm_lowering import pool_grad

    shapes = {"tiles": ([2, 2], [2, 2], [2, 3, 4, 3]), "overlap": ([2, 2], [1, 1], [2, 3, 7, 6]),
              "leftover": ([2, 2], [2, 2], [2, 3, 4, 3]), "three": ([3, 3], [3, 3], [2, 3, 2, 2])}
    for name, (kernel, stride, out) in shapes.items():
        src = relax.Var("x", relax.TensorType([2, 3, 8, 6 if name == "tiles" else 7], "float32"))
        dy = relax.Var("dy", relax.TensorType(out, "float32"))
        bb = relax.BlockBuilder()
        with bb.function("main", [dy, src]):
            with bb.dataflow():
                g = bb.emit_output(relax.op.grad.max_pool2d_backward(dy, src, kernel, stride, [0, 0, 0, 0], [1, 1]))
            bb.emit_func_output(g)
        mod = bb.get()
        call = mod["main"].body.blocks[0].bindings[0].value
        assert pool_grad.windows_tile(call) == (name == "tiles"), name
        text = library_dispatch(mod).script()
        assert ('"ratex.lib.max_pool2d_backward"' in text) == (name != "tiles"), name
        if name == "tiles":
            legalized = relax.transform.LegalizeOps(pool_grad.LEGALIZE)(mod).script()
            assert 'T.sblock("max_pool2d_argmax")' in legalized and "ratex.materialize" in legalized


def _python_aten_out(op, template, kwargs, *tensors):
    """Run the Python `ratex.lib.aten_out` kernel (the one GPU programs call) on CPU tensors."""
    import json

    import torch

    from ratex.core import kernels

    out = torch.empty_like(tensors[0])
    attrs = json.dumps({"op": op, "args": template, "kwargs": kwargs})
    kernels._aten_out(*(tvm.runtime.from_dlpack(t) for t in tensors), attrs, tvm.runtime.from_dlpack(out))
    return out


def test_python_aten_kernel_passes_keyword_only_arguments_by_keyword():
    """library_dispatch sends gelu's `approximate` as the template's second entry; ATen takes it
    only as a keyword (`gelu() takes 1 positional argument`, the scripted GPT on GPU)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(4, 6, generator=g) * 3, torch.randn(4, 6, generator=g)
    for approximate in ("none", "tanh"):
        got = _python_aten_out("aten.gelu.default", [{"tensor": 0}, approximate], {}, x)
        torch.testing.assert_close(got, F.gelu(x, approximate=approximate))
        as_keyword = _python_aten_out("aten.gelu.default", [{"tensor": 0}], {"approximate": approximate}, x)
        torch.testing.assert_close(as_keyword, got)
        grad = _python_aten_out("aten.gelu_backward.default", [{"tensor": 0}, {"tensor": 1}, approximate], {}, dy, x)
        torch.testing.assert_close(grad, torch.ops.aten.gelu_backward(dy, x, approximate=approximate))
    want = torch.ops.aten._softmax_backward_data(dy, torch.softmax(x, 1), 1, torch.float32)
    got = _python_aten_out("aten._softmax_backward_data.default",
                           [{"tensor": 0}, {"tensor": 1}, 1, {"dtype": "float32"}], {}, dy, torch.softmax(x, 1))
    torch.testing.assert_close(got, want)


def test_python_aten_kernel_rejects_arguments_it_cannot_place():
    import torch

    x = torch.randn(3)
    with pytest.raises(TypeError, match=r"aten.gelu.default takes 2 arguments, the call has 3"):
        _python_aten_out("aten.gelu.default", [{"tensor": 0}, "tanh", 1], {}, x)
    with pytest.raises(TypeError, match="'approximate' by position and by keyword"):
        _python_aten_out("aten.gelu.default", [{"tensor": 0}, "tanh"], {"approximate": "none"}, x)


# A scripted Linear-GELU(tanh)-Linear trained for 3 SGD steps on the device sys.argv[1] names; prints the losses.
_GELU_STEPS = """
import json, sys
import torch, torch.nn as nn, torch.nn.functional as F
import ratex
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.GELU("tanh"), nn.Linear(16, 4))
if sys.argv[1] == "lazy":
    model = ratex.jit.script(model)
model.to(sys.argv[1])
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
losses = []
for _ in range(3):
    opt.zero_grad()
    loss = F.mse_loss(model(x.to(sys.argv[1])), y.to(sys.argv[1]))
    loss.backward()
    opt.step()
    losses.append(loss.item())
print(json.dumps(losses))
"""


def test_scripted_gelu_tanh_trains_with_the_python_kernels():
    """The Python kernels are what GPU programs call; on CPU they run where the native library
    is off. The scripted GELU(tanh) goes to `ratex.lib.aten_out` with `approximate` in its template."""
    import json
    import os
    import subprocess
    import sys

    def losses(device):
        env = dict(os.environ, RATEX_NATIVE_KERNELS="0", RATEX_KERNELS="library", RATEX_CACHE_DIR="")
        proc = subprocess.run([sys.executable, "-c", _GELU_STEPS, device], env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    want = losses("cpu")
    assert losses("lazy") == pytest.approx(want, rel=1e-4, abs=1e-6)


def test_embedding_gradients_run_by_aten(tmp_path, monkeypatch):
    """The lazy path's embedding_dense_backward (padding row, scaled by frequency) and relax
    Gradient's take_backward (a scripted embedding) call ATen's kernel: TVM's scatter-add loop
    is far slower. Results as CPU PyTorch's."""
    import torch

    import ratex.lazy_tensor_core.core.lazy_model as lm
    from ratex import config
    from ratex.core import sync

    aten = torch.ops.aten
    g = torch.Generator().manual_seed(0)
    idx, grad = torch.tensor([[1, 3, 1], [0, 3, 4]]), torch.randn(2, 3, 4, generator=g)
    dev = lm.lazy_device()
    ir = tmp_path / "ir.txt"
    monkeypatch.setattr(config, "SAVE_IR", str(ir))
    monkeypatch.setattr(config, "KERNELS", "AUTO")
    sync.reset_cache()
    for padding_idx, by_freq in ((-1, False), (3, True)):
        got = aten.embedding_dense_backward(grad.to(dev), idx.to(dev), 6, padding_idx, by_freq).cpu()
        torch.testing.assert_close(got, aten.embedding_dense_backward(grad, idx, 6, padding_idx, by_freq))
    assert ir.read_text().count('"ratex.lib.aten_out"') == 2
    sync.reset_cache()

    bb = relax.BlockBuilder()
    dy = relax.Var("dy", relax.TensorType((5, 4), "float32"))
    table = relax.Var("table", relax.TensorType((6, 4), "float32"))
    rows = relax.Var("rows", relax.TensorType((5,), "int64"))
    with bb.function("main", [dy, table, rows]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.grad.take_backward(dy, table, rows, axis=0))
        bb.emit_func_output(out)
    mod = bb.get()
    assert '"aten.embedding_dense_backward.default"' in library_dispatch(mod).script().replace('\\"', '"')
    args = [torch.randn(5, 4, generator=g), torch.randn(6, 4, generator=g), torch.tensor([1, 5, 1, 0, 2])]
    want = torch.zeros(6, 4).index_add_(0, args[2], args[0])
    for library in (True, False):
        vm = relax.VirtualMachine(build(mod, resolve_target("CPU"), Options(library=library)), tvm.cpu())
        got = torch.from_dlpack(vm["main"](*(tvm.runtime.from_dlpack(a) for a in args)))
        torch.testing.assert_close(got, want)
