"""The `ratex.lib.*` kernel library: PyTorch's own CPU kernels, called from compiled programs.

tvm_lowering/ops/library.py emits `call_pure_packed("ratex.lib.<op>", ...)`
for matmul and convolution; these functions receive TVM tensors, view them as
torch tensors through DLPack (no copies), run ATen's kernel and hand the result
back the same way. Transposed operands arrive untransposed with a flag and are
passed as strided views. Every result is a new tensor, never an input or a view
of one: buffer donation (tvm_lowering/inplace.py) relies on that.
"""
import functools
import json

import torch
import tvm

aten = torch.ops.aten


@functools.lru_cache(maxsize=None)
def _attrs(text: str) -> dict:
    return json.loads(str(text))


def _t(x, transposed):
    t = torch.from_dlpack(x)
    return t.t() if transposed else t


def _out(t):
    return tvm.runtime.from_dlpack(t.contiguous())


def _mm(a, b, attrs):
    cfg = _attrs(attrs)
    return _out(torch.mm(_t(a, cfg["ta"]), _t(b, cfg["tb"])))


def _addmm(bias, a, b, attrs):
    cfg = _attrs(attrs)
    out = torch.addmm(torch.from_dlpack(bias), _t(a, cfg["ta"]), _t(b, cfg["tb"]), beta=cfg["beta"], alpha=cfg["alpha"])
    return _out(out)


def _bmm(a, b, attrs):
    return _out(torch.bmm(torch.from_dlpack(a), torch.from_dlpack(b)))


def _convolution(*args):
    cfg = _attrs(args[-1])
    x, w = torch.from_dlpack(args[0]), torch.from_dlpack(args[1])
    b = torch.from_dlpack(args[2]) if cfg["bias"] else None
    out = aten.convolution.default(
        x, w, b, cfg["stride"], cfg["padding"], cfg["dilation"], cfg["transposed"], cfg["output_padding"], cfg["groups"]
    )
    return _out(out)


def _same_or_pad(x, padding):
    """Relax padding is (top, left, bottom, right); torch's conv takes a symmetric pair."""
    top, left, bottom, right = padding
    if top == bottom and left == right:
        return x, [top, left]
    return torch.nn.functional.pad(x, [left, right, top, bottom]), [0, 0]


def _conv2d(x, w, attrs):
    cfg = _attrs(attrs)
    xt, pad = _same_or_pad(torch.from_dlpack(x), cfg["padding"])
    return _out(torch.conv2d(xt, torch.from_dlpack(w), None, cfg["stride"], pad, cfg["dilation"], cfg["groups"]))


def _conv2d_transpose(x, w, attrs):
    cfg = _attrs(attrs)
    top, left = cfg["padding"][:2]  # the pass only sends symmetric padding here
    out = torch.conv_transpose2d(
        torch.from_dlpack(x), torch.from_dlpack(w), None, cfg["stride"], [top, left], cfg["output_padding"],
        cfg["groups"], cfg["dilation"],
    )
    return _out(out)


def _conv2d_weight_grad(x, dy, attrs):
    cfg = _attrs(attrs)
    weight = torch.empty(cfg["weight"], dtype=torch.from_dlpack(x).dtype)  # only its sizes are read
    _, gw, _ = aten.convolution_backward.default(
        torch.from_dlpack(dy), torch.from_dlpack(x), weight, None, cfg["stride"], cfg["padding"], cfg["dilation"],
        False, [0, 0], 1, [False, True, False],
    )
    return _out(gw)


def _max_pool2d_backward(dy, x, attrs):
    cfg = _attrs(attrs)
    args = (cfg["kernel"], cfg["stride"], cfg["padding"], cfg["dilation"], cfg["ceil_mode"])
    xt = torch.from_dlpack(x)
    _, indices = aten.max_pool2d_with_indices.default(xt, *args)
    return _out(aten.max_pool2d_with_indices_backward.default(torch.from_dlpack(dy), xt, *args, indices))


def _avg_pool2d_backward(dy, x, attrs):
    cfg = _attrs(attrs)
    out = aten.avg_pool2d_backward.default(
        torch.from_dlpack(dy), torch.from_dlpack(x), cfg["kernel"], cfg["stride"], cfg["padding"], cfg["ceil_mode"],
        cfg["count_include_pad"], None,
    )
    return _out(out)


def _matmul(a, b):
    return _out(torch.matmul(torch.from_dlpack(a), torch.from_dlpack(b)))


def _convolution_backward(g, x, w, attrs):
    cfg = _attrs(attrs)
    outs = aten.convolution_backward.default(
        torch.from_dlpack(g), torch.from_dlpack(x), torch.from_dlpack(w), cfg["bias_sizes"], cfg["stride"],
        cfg["padding"], cfg["dilation"], cfg["transposed"], cfg["output_padding"], cfg["groups"], cfg["output_mask"],
    )
    return [_out(o if o is not None else torch.zeros(1)) for o in outs]  # (a None output: a placeholder)


@functools.lru_cache(maxsize=None)
def _aten_call(attrs: str):
    """(op, args template, kwargs) of a `ratex.lib.aten` call; see tvm_lowering/ops/library.py."""
    cfg = json.loads(str(attrs))
    _, name, overload = cfg["op"].split(".")  # "aten.<op>.<overload>"
    op = getattr(getattr(aten, name), overload)
    args = [getattr(torch, a["dtype"]) if isinstance(a, dict) and "dtype" in a else a for a in cfg["args"]]
    kwargs = {k: getattr(torch, v) if k.endswith("dtype") and isinstance(v, str) else v for k, v in cfg["kwargs"].items()}
    return op, args, kwargs


def _aten(*args):
    op, template, kwargs = _aten_call(args[-1])
    tensors = [torch.from_dlpack(x) for x in args[:-1]]
    call = [tensors[a["tensor"]] if isinstance(a, dict) and "tensor" in a else a for a in template]
    return _out(op(*call, **kwargs))


for _name, _fn in {
    "mm": _mm, "addmm": _addmm, "bmm": _bmm, "convolution": _convolution, "convolution_backward": _convolution_backward,
    "conv2d": _conv2d, "conv2d_transpose": _conv2d_transpose, "matmul": _matmul,
    "conv2d_weight_grad": _conv2d_weight_grad, "max_pool2d_backward": _max_pool2d_backward,
    "avg_pool2d_backward": _avg_pool2d_backward, "aten": _aten,
}.items():
    tvm.register_global_func(f"ratex.lib.{_name}", _fn, override=True)
