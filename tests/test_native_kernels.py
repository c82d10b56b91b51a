"""The native ratex.lib.* kernels (csrc/kernels.cc) compute what the Python ones and CPU PyTorch compute."""
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import tvm
import tvm_ffi
from torch import nn

import ratex
import ratex.core.kernels as K
from ratex import config
from test_training import train

pytestmark = pytest.mark.skipif(
    K.NATIVE is None,
    reason=f"native kernels not loaded ({K._NATIVE_PATH} missing, or RATEX_NATIVE_KERNELS=0): run scripts/setup.sh",
)


def _mapped_libraries():
    """The paths of the native libraries this process has mapped."""
    with open("/proc/self/maps") as maps:
        return {Path(line.split()[-1]) for line in maps if line.rstrip().endswith("/libratex_kernels.so")}


def test_loaded_from_the_installed_package():
    # the copy the process mapped, not just the path the loader was given
    assert _mapped_libraries() == {Path(ratex.__file__).resolve().parent / "_lib" / "libratex_kernels.so"}


def test_refuses_a_library_built_for_another_torch(monkeypatch, capsys):
    built_for = K.NATIVE.RatexNativeTorchVersion().decode()
    monkeypatch.setattr(torch, "__version__", "0.0.1+other")
    assert K._load_native() is None
    assert f"not using the native kernels (built for torch {built_for}, running 0.0.1+other)" in capsys.readouterr().out


def test_opt_out_keeps_the_python_kernels():
    code = "import ratex.core.kernels as K; print(K.NATIVE is None, K._NATIVE_PATH.exists())"
    env = {**os.environ, "RATEX_NATIVE_KERNELS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True"]


def _tvm(t):
    return tvm.runtime.from_dlpack(t)


def _native(name, *tensors, attrs, out=None):
    """Call native kernel `name` on torch tensors; its result (or `out`) as a torch tensor."""
    fn = tvm.get_global_func(f"ratex.lib.{name}")
    args = [_tvm(t) for t in tensors] + [json.dumps(attrs)]
    if out is not None:
        fn(*args, _tvm(out))
        return out
    result = fn(*args)
    return [torch.from_dlpack(r) for r in result] if isinstance(result, tvm_ffi.Array) else torch.from_dlpack(result)


def _python(name, *tensors, attrs, out=None):
    """The same call of the Python kernel ratex/core/kernels.py defines."""
    fn = getattr(K, f"_{name}")
    args = [_tvm(t) for t in tensors] + [json.dumps(attrs)]
    if out is not None:
        fn(*args, _tvm(out))
        return out
    result = fn(*args)
    return [torch.from_dlpack(r) for r in result] if isinstance(result, list) else torch.from_dlpack(result)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed + sum(shape)))


def _t(x, flag):
    return x.transpose(-2, -1) if flag else x


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_matmuls_with_transposed_operands(ta, tb):
    a, b = _randn(*((5, 3) if ta else (3, 5))), _randn(*((4, 5) if tb else (5, 4)), seed=1)
    want = _t(a, ta) @ _t(b, tb)
    got = _native("mm_out", a, b, attrs={"ta": ta, "tb": tb}, out=torch.empty(3, 4))
    torch.testing.assert_close(got, want)

    bias = _randn(4, seed=2)
    attrs = {"ta": ta, "tb": tb, "beta": 0.5, "alpha": 2.0}
    got = _native("addmm_out", bias, a, b, attrs=attrs, out=torch.empty(3, 4))
    torch.testing.assert_close(got, 0.5 * bias + 2.0 * want)

    # batched, with a broadcast operand (relax matmul: torch.matmul's semantics)
    a3 = _randn(*((2, 5, 3) if ta else (2, 3, 5)), seed=3)
    got = _native("matmul_out", a3, b, attrs={"ta": ta, "tb": tb}, out=torch.empty(2, 3, 4))
    torch.testing.assert_close(got, torch.matmul(_t(a3, ta), _t(b, tb)))

    b3 = _randn(*((2, 4, 5) if tb else (2, 5, 4)), seed=4)
    got = _native("bmm_out", a3, b3, attrs={"ta": ta, "tb": tb}, out=torch.empty(2, 3, 4))
    torch.testing.assert_close(got, torch.bmm(_t(a3, ta), _t(b3, tb)))


def _gemm_library(a, b, out, ta=False, tb=False, matmul=False):
    return str(tvm.get_global_func("ratex.lib.gemm_library")(_tvm(a), _tvm(b), json.dumps({"ta": ta, "tb": tb}),
                                                             _tvm(out), matmul))


def _close(got, want):
    """float32 products of 256-long sums against float64 ones: rounding, not a wrong sum."""
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-4)


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_large_float32_products_run_on_onednn(ta, tb):
    # 64 x 256 x 136: above csrc/kernels.cc's threshold for oneDNN
    a, b = _randn(*((256, 64) if ta else (64, 256))), _randn(*((136, 256) if tb else (256, 136)), seed=1)
    want = _t(a, ta).double() @ _t(b, tb).double()
    out = torch.empty(64, 136)
    assert _gemm_library(a, b, out, ta, tb) == "onednn"
    _close(_native("mm_out", a, b, attrs={"ta": ta, "tb": tb}, out=out), want)

    for bias in (_randn(136, seed=2), _randn(64, 136, seed=3), _randn(64, 1, seed=4), torch.tensor(3.0)):
        attrs = {"ta": ta, "tb": tb, "beta": 0.5, "alpha": 2.0}
        got = _native("addmm_out", bias, a, b, attrs=attrs, out=torch.full((64, 136), 7.0))
        _close(got, 0.5 * bias.double() + 2.0 * want)
    # beta 0: the bias is not read, as torch.addmm ignores it, NaN included
    attrs = {"ta": ta, "tb": tb, "beta": 0, "alpha": 1}
    _close(_native("addmm_out", torch.full((136,), float("nan")), a, b, attrs=attrs, out=torch.empty(64, 136)), want)

    a3 = _randn(*((3, 256, 64) if ta else (3, 64, 256)), seed=5)
    b3 = _randn(*((3, 136, 256) if tb else (3, 256, 136)), seed=6)
    out3 = torch.empty(3, 64, 136)
    assert _gemm_library(a3, b3, out3, ta, tb) == "onednn"
    _close(_native("bmm_out", a3, b3, attrs={"ta": ta, "tb": tb}, out=out3), _t(a3, ta).double() @ _t(b3, tb).double())
    # matmul: 4-d batches merged into one, a 3-d row-major operand's batch folded into its rows
    a4, b4 = a3.reshape(3, 1, *a3.shape[1:]), b3.reshape(3, 1, *b3.shape[1:])
    out4 = torch.empty(3, 1, 64, 136)
    assert _gemm_library(a4, b4, out4, ta, tb, matmul=True) == "onednn"
    _close(_native("matmul_out", a4, b4, attrs={"ta": ta, "tb": tb}, out=out4), _t(a4, ta).double() @ _t(b4, tb).double())
    rows = _randn(2, 32, 256, seed=7)
    out = torch.empty(2, 32, 136)
    assert _gemm_library(rows, b, out, False, tb, matmul=True) == "onednn"
    _close(_native("matmul_out", rows, b, attrs={"ta": False, "tb": tb}, out=out), rows.double() @ _t(b, tb).double())


def test_small_skinny_and_other_products_stay_with_aten():
    def library(m, k, n, dtype=torch.float32):
        return _gemm_library(torch.zeros(m, k, dtype=dtype), torch.zeros(k, n, dtype=dtype), torch.zeros(m, n, dtype=dtype))

    assert library(64, 256, 136) == "onednn"
    assert library(64, 120, 84) == "aten"  # oneDNN's fixed cost per call outweighs its speed
    assert library(1, 4096, 4096) == "aten"  # a matrix-vector product: oneDNN's is far slower
    assert library(4096, 4096, 4) == "aten"
    assert library(64, 256, 136, torch.float64) == "aten"  # oneDNN has no float64 matmul
    # matmul whose batch broadcasts: ATen's matmul
    out = torch.empty(3, 64, 136)
    assert _gemm_library(_randn(3, 64, 256), _randn(1, 256, 136), out, matmul=True) == "aten"
    off = tvm.get_global_func("ratex.lib.set_onednn_gemm")
    try:
        assert not off(False)  # RATEX_ONEDNN_GEMM=0
        assert library(64, 256, 136) == "aten"
    finally:
        off(config.ONEDNN_GEMM)


def test_opt_out_keeps_products_on_aten():
    code = ("import json, torch, tvm, ratex.core.kernels; z = tvm.runtime.from_dlpack; "
            "print(tvm.get_global_func('ratex.lib.gemm_library')(z(torch.zeros(64, 256)), z(torch.zeros(256, 136)), "
            "json.dumps({'ta': False, 'tb': False}), z(torch.zeros(64, 136)), False))")
    env = {**os.environ, "RATEX_ONEDNN_GEMM": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["aten"]


_CONVS = [  # (x, w, attrs of aten.convolution)
    ((2, 4, 9, 9), (6, 2, 3, 3), dict(stride=[2, 1], padding=[1, 2], dilation=[1, 2], transposed=False,
                                      output_padding=[0, 0], groups=2)),
    ((2, 4, 5, 5), (4, 3, 3, 3), dict(stride=[2, 2], padding=[1, 0], dilation=[1, 1], transposed=True,
                                      output_padding=[1, 0], groups=1)),
]


@pytest.mark.parametrize("xs, ws, attrs", _CONVS, ids=["grouped", "transposed"])
@pytest.mark.parametrize("bias", [False, True])
def test_convolution(xs, ws, attrs, bias):
    x, w = _randn(*xs), _randn(*ws, seed=1)
    out_channels = ws[1] * attrs["groups"] if attrs["transposed"] else ws[0]
    b = [_randn(out_channels, seed=2)] if bias else []
    got = _native("convolution", x, w, *b, attrs={**attrs, "bias": bias})
    want = torch.ops.aten.convolution(x, w, b[0] if bias else None, *attrs.values())
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("xs, ws, attrs", _CONVS, ids=["grouped", "transposed"])
@pytest.mark.parametrize("mask", [[True, True, True], [False, True, False]])
def test_convolution_backward(xs, ws, attrs, mask):
    x, w = _randn(*xs), _randn(*ws, seed=1)
    g = torch.randn_like(torch.ops.aten.convolution(x, w, None, *attrs.values()))
    out_channels = ws[1] * attrs["groups"] if attrs["transposed"] else ws[0]
    cfg = {**attrs, "bias_sizes": [out_channels], "output_mask": mask}
    got, want = _native("convolution_backward", g, x, w, attrs=cfg), _python("convolution_backward", g, x, w, attrs=cfg)
    assert len(got) == 3
    for got_one, want_one in zip(got, want):
        torch.testing.assert_close(got_one, want_one)


@pytest.mark.parametrize("padding", [[1, 1, 1, 1], [1, 0, 2, 1]], ids=["symmetric", "asymmetric"])
def test_conv2d(padding):
    x, w = _randn(2, 4, 9, 8), _randn(6, 2, 3, 3, seed=1)
    attrs = {"stride": [2, 1], "padding": padding, "dilation": [1, 2], "groups": 2}
    top, left, bottom, right = padding
    want = torch.conv2d(F.pad(x, [left, right, top, bottom]), w, None, [2, 1], 0, [1, 2], 2)
    torch.testing.assert_close(_native("conv2d", x, w, attrs=attrs), want)


def test_conv2d_transpose():
    x, w = _randn(2, 4, 5, 5), _randn(4, 3, 3, 3, seed=1)
    attrs = {"stride": [2, 2], "padding": [1, 1, 1, 1], "output_padding": [1, 1], "dilation": [1, 1], "groups": 2}
    want = torch.conv_transpose2d(x, w, None, 2, 1, 1, 2, 1)
    torch.testing.assert_close(_native("conv2d_transpose", x, w, attrs=attrs), want)


def test_conv2d_weight_grad():
    x, w = _randn(2, 3, 9, 9), _randn(4, 3, 3, 3, seed=1)
    xr = x.clone().requires_grad_()
    y = torch.conv2d(xr, w.requires_grad_(), None, 2, 1, 1)
    dy = torch.randn_like(y)
    (want,) = torch.autograd.grad(y, w, dy)
    attrs = {"stride": [2, 2], "padding": [1, 1], "dilation": [1, 1], "weight": list(w.shape)}
    torch.testing.assert_close(_native("conv2d_weight_grad", x, dy, attrs=attrs), want)


@pytest.mark.parametrize("kind", ["max", "avg"])
def test_pooling_gradients(kind):
    x = _randn(2, 3, 9, 9)
    attrs = {"kernel": [3, 3], "stride": [2, 2], "padding": [1, 1], "dilation": [1, 1], "ceil_mode": True,
             "count_include_pad": False}
    xr = x.clone().requires_grad_()
    if kind == "max":
        y = F.max_pool2d(xr, 3, 2, 1, 1, ceil_mode=True)
    else:
        y = F.avg_pool2d(xr, 3, 2, 1, ceil_mode=True, count_include_pad=False)
    dy = torch.randn_like(y)
    (want,) = torch.autograd.grad(y, xr, dy)
    torch.testing.assert_close(_native(f"{kind}_pool2d_backward", dy, x, attrs=attrs), want)


def _aten_attrs(op, args, **kwargs):
    return {"op": op, "args": args, "kwargs": kwargs}


@pytest.mark.parametrize("op, args, kwargs, n", [
    ("aten._softmax.default", [{"tensor": 0}, 1, False], {}, 1),
    ("aten._log_softmax.default", [{"tensor": 0}, -1, False], {}, 1),
    ("aten._softmax_backward_data.default", [{"tensor": 0}, {"tensor": 1}, 1, {"dtype": "float32"}], {}, 2),
    ("aten._log_softmax_backward_data.default", [{"tensor": 0}, {"tensor": 1}, 0, {"dtype": "float32"}], {}, 2),
    ("aten.gelu.default", [{"tensor": 0}], {"approximate": "tanh"}, 1),
    ("aten.gelu.default", [{"tensor": 0}], {}, 1),
    ("aten.gelu_backward.default", [{"tensor": 0}, {"tensor": 1}], {"approximate": "none"}, 2),
    ("aten.tanh.default", [{"tensor": 0}], {}, 1),  # no native kernel: the Python one runs it
])
def test_aten_out(op, args, kwargs, n):
    tensors = [_randn(3, 5, seed=i) for i in range(n)]
    attrs = _aten_attrs(op, args, **kwargs)
    got = _native("aten_out", *tensors, attrs=attrs, out=torch.empty(3, 5))
    want = _python("aten_out", *tensors, attrs=attrs, out=torch.empty(3, 5))
    torch.testing.assert_close(got, want)


def test_aten_errors_surface_as_ffi_errors():
    a = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match=r"ratex\.lib\.mm_out: .*cannot be multiplied"):
        _native("mm_out", a, a, attrs={"ta": False, "tb": False}, out=torch.empty(3, 4))
    with pytest.raises(ValueError, match="no field 'tb'"):
        _native("mm_out", a, a, attrs={"ta": False}, out=torch.empty(3, 4))
    with pytest.raises(ValueError, match="malformed kernel attributes"):
        tvm.get_global_func("ratex.lib.conv2d")(_tvm(a), _tvm(a), '{"stride": [1, 1')


class ConvNet(nn.Module):
    """Non-default conv attributes, pooling, and a linear layer: each heavy op a library call."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, stride=2, padding=1, groups=2)
        self.fc = nn.Linear(4 * 2 * 2, 5)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return F.log_softmax(self.fc(torch.flatten(x, 1)), dim=1)


def test_lazy_training_matches_cpu(dev):
    torch.manual_seed(0)
    model = ConvNet()
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(3, 2, 9, 9, generator=g), torch.randint(0, 5, (3,), generator=g)) for _ in range(3)]

    want_losses, want_params = train(copy.deepcopy(model), torch.device("cpu"), data, lr=0.1)
    got_losses, got_params = train(model, dev, data, lr=0.1)
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-4, atol=1e-5)
    for got, want in zip(got_params, want_params):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
