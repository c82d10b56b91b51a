"""The `ratex.lib.*` kernel library: PyTorch's own kernels, called from compiled programs.

tvm_lowering/ops/library.py and library_dispatch.py emit calls of these
functions for matmul, convolution and a few other ops; they receive TVM
tensors, view them as torch tensors through DLPack (no copies) and run ATen's
kernel (CPU, or CUDA for GPU data). The `*_out` ones are destination-passing (`call_dps_packed`): they write
into an output the program allocated and planned, so a large result costs no
fresh allocation. The others hand back a new tensor the same way, never an input
or a view of one: buffer donation (tvm_lowering/inplace.py) relies on that.
Transposed operands arrive untransposed with a flag and are passed as strided views.

These Python functions are the fallback: when the native library exists (csrc/kernels.cc,
built by the install into the package as ratex/_lib/libratex_kernels.so: see setup.py) it
replaces them with C++ versions of the same names and calling convention (on GPU, where it
was built against a torch with CUDA). Compiled
programs run on the executor thread while Python traces the next step, and each Python
kernel call has to wait for the GIL (which markedly slows LeNet's pipelined steps'
kernels); the native ones never take it.
`RATEX_NATIVE_KERNELS=0` keeps the Python kernels.
"""
import ctypes
import functools
import importlib.resources
import json
from pathlib import Path

import torch
import tvm

from .. import config
from .device import backend_class

aten = torch.ops.aten


@functools.lru_cache(maxsize=None)
def _attrs(text: str) -> dict:
    return json.loads(str(text))


def _t(x, transposed):
    """x as a torch tensor; with `transposed`, its last two axes swapped (a strided view)."""
    t = torch.from_dlpack(x)
    return t.transpose(-2, -1) if transposed else t


def _out(t):
    return tvm.runtime.from_dlpack(t.contiguous())


def _product_out(fn):
    """mm/bmm/matmul into `out`, operands transposed in their last two axes where flagged."""

    def kernel(a, b, attrs, out):
        cfg = _attrs(attrs)
        fn(_t(a, cfg["ta"]), _t(b, cfg["tb"]), out=torch.from_dlpack(out))

    return kernel


_mm_out, _bmm_out, _matmul_out = _product_out(torch.mm), _product_out(torch.bmm), _product_out(torch.matmul)


def _addmm_out(bias, a, b, attrs, out):
    cfg = _attrs(attrs)
    torch.addmm(
        torch.from_dlpack(bias), _t(a, cfg["ta"]), _t(b, cfg["tb"]), beta=cfg["beta"], alpha=cfg["alpha"],
        out=torch.from_dlpack(out),
    )


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
    xt = torch.from_dlpack(x)
    weight = torch.empty(cfg["weight"], dtype=xt.dtype, device=xt.device)  # only its sizes are read
    _, gw, _ = aten.convolution_backward.default(
        torch.from_dlpack(dy), xt, weight, None, cfg["stride"], cfg["padding"], cfg["dilation"],
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


def _convolution_backward(g, x, w, attrs):
    cfg = _attrs(attrs)
    gt = torch.from_dlpack(g)
    outs = aten.convolution_backward.default(
        gt, torch.from_dlpack(x), torch.from_dlpack(w), cfg["bias_sizes"], cfg["stride"],
        cfg["padding"], cfg["dilation"], cfg["transposed"], cfg["output_padding"], cfg["groups"], cfg["output_mask"],
    )
    # (a None output: a float32 placeholder, as library.py types it)
    return [_out(o if o is not None else torch.zeros(1, device=gt.device)) for o in outs]


@functools.lru_cache(maxsize=None)
def _aten_call(attrs: str):
    """(op, positional args template, keyword args template) of a `ratex.lib.aten` call; see
    tvm_lowering/ops/library.py. Template entries past the op's positional parameters go to their
    keyword-only ones by name: ATen takes `approximate` of gelu only as `approximate=`."""
    cfg = json.loads(str(attrs))
    _, name, overload = cfg["op"].split(".")  # "aten.<op>.<overload>"
    op = getattr(getattr(aten, name), overload)
    args = [getattr(torch, a["dtype"]) if isinstance(a, dict) and "dtype" in a else a for a in cfg["args"]]
    kwargs = {k: getattr(torch, v) if k.endswith("dtype") and isinstance(v, str) else v for k, v in cfg["kwargs"].items()}
    params = op._schema.arguments
    positional = sum(not p.kwarg_only for p in params)
    if len(args) > len(params):
        raise TypeError(f"ratex.lib.aten_out: {cfg['op']} takes {len(params)} arguments, the call has {len(args)}")
    for param, value in zip(params[positional:], args[positional:]):
        if param.name in kwargs:
            raise TypeError(f"ratex.lib.aten_out: {cfg['op']} got '{param.name}' by position and by keyword")
        kwargs[param.name] = value
    return op, args[:positional], kwargs


@functools.lru_cache(maxsize=None)
def _out_overload(op):
    """(op's out= overload, the name of its out argument), or (None, None)."""
    packet = getattr(aten, op._schema.name.split("::")[1])
    for name in packet.overloads():
        overload = getattr(packet, name)
        outs = [a for a in overload._schema.arguments if a.is_out]
        if len(outs) == 1 and len(overload._schema.arguments) == len(op._schema.arguments) + 1:
            return overload, outs[0].name
    return None, None


def _aten_out(*args):
    op, template, kwargs = _aten_call(args[-2])
    tensors = [torch.from_dlpack(x) for x in args[:-2]]

    def value(a):
        return tensors[a["tensor"]] if isinstance(a, dict) and "tensor" in a else a

    call = [value(a) for a in template]
    named = {k: value(a) for k, a in kwargs.items()}
    out = torch.from_dlpack(args[-1])
    out_op, out_name = _out_overload(op)
    if out_op is None:
        out.copy_(op(*call, **named))
    else:
        out_op(*call, **named, **{out_name: out})


for _name, _fn in {
    "mm_out": _mm_out, "addmm_out": _addmm_out, "bmm_out": _bmm_out, "matmul_out": _matmul_out, "aten_out": _aten_out,
    "convolution": _convolution, "convolution_backward": _convolution_backward,
    "conv2d": _conv2d, "conv2d_transpose": _conv2d_transpose,
    "conv2d_weight_grad": _conv2d_weight_grad, "max_pool2d_backward": _max_pool2d_backward,
    "avg_pool2d_backward": _avg_pool2d_backward,
}.items():
    tvm.register_global_func(f"ratex.lib.{_name}", _fn, override=True)


def native_library_path() -> Path:
    """Where the native library is loaded from (it may be missing): ratex's package data."""
    # setup.py installs it there: into the wheel, or into the source tree for an editable install.
    return Path(str(importlib.resources.files("ratex") / "_lib" / "libratex_kernels.so"))


_NATIVE_PATH = native_library_path()
_REBUILD = "rebuild it with scripts/setup.sh in a checkout, or reinstall ratex"


def takes_cuda(lib) -> bool:
    """Whether the native library `lib` was built against a torch with CUDA (its kernels then take
    CUDA tensors as well as CPU ones); a library built before the symbol existed did not."""
    return hasattr(lib, "RatexNativeCuda") and bool(lib.RatexNativeCuda())


def _load_native():
    """The native kernel library, registered over the Python kernels; None when it is
    turned off, not built, built for another torch (its ATen ABI may differ), or, for a GPU
    backend, built without CUDA (it could not take the programs' CUDA tensors)."""
    device_type = backend_class().native_kernels  # "cpu", "cuda", or None: the Python kernels
    if not config.NATIVE_KERNELS or device_type is None or not _NATIVE_PATH.exists():
        return None
    try:
        lib = ctypes.CDLL(str(_NATIVE_PATH))
    except OSError as e:
        print(f"ratex: not using the native kernels ({e}); {_REBUILD}")
        return None
    lib.RatexNativeTorchVersion.restype = ctypes.c_char_p
    built_for = lib.RatexNativeTorchVersion().decode()
    if built_for != torch.__version__:
        print(f"ratex: not using the native kernels (built for torch {built_for}, running {torch.__version__}); "
              f"{_REBUILD}")
        return None
    if device_type == "cuda" and not takes_cuda(lib):
        if torch.version.cuda is not None:  # (a torch without CUDA can't run the GPU backend at all)
            print(f"ratex: not using the native kernels on GPU (built without CUDA: is the CUDA toolkit "
                  f"installed?); {_REBUILD}")
        return None
    if lib.RatexRegisterNativeKernels() != 0:
        raise RuntimeError(f"registering the native kernels of {_NATIVE_PATH} failed")
    tvm.get_global_func("ratex.lib.set_onednn_gemm")(config.ONEDNN_GEMM)
    # The program runner (csrc/runner.cc); a library built before it existed has none.
    if hasattr(lib, "RatexRegisterRunner") and lib.RatexRegisterRunner() != 0:
        raise RuntimeError(f"registering the native program runner of {_NATIVE_PATH} failed")
    # The host-side fast paths (csrc/host.cc); likewise optional.
    if hasattr(lib, "RatexRegisterHost") and lib.RatexRegisterHost() != 0:
        raise RuntimeError(f"registering the native host functions of {_NATIVE_PATH} failed")
    return lib


NATIVE = _load_native()
