"""Kernel library dispatch: heavy Relax ops become ratex.lib.* calls and compute what TVM's code computes."""
import numpy as np
import tvm
from tvm import relax

import ratex  # noqa: F401  (registers ratex.lib.*)
from tvm_lowering import build, resolve_target
from tvm_lowering.library_dispatch import library_dispatch


def _module():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 3, 9, 9), "float32"))
    w = relax.Var("w", relax.TensorType((4, 3, 3, 3), "float32"))
    wt = relax.Var("wt", relax.TensorType((4, 2, 3, 3), "float32"))
    m = relax.Var("m", relax.TensorType((5, 7), "float32"))
    with bb.function("main", [x, w, wt, m]):
        with bb.dataflow():
            c = bb.emit(relax.op.nn.conv2d(x, w, strides=[2, 2], padding=[1, 0, 1, 2], dilation=[1, 1]))
            t = bb.emit(relax.op.nn.conv2d_transpose(c, wt, strides=[2, 2], padding=[1, 1, 1, 1], output_padding=[1, 1]))
            mm = bb.emit(relax.op.matmul(m, relax.op.permute_dims(m)))
            out = bb.emit_output(relax.Tuple([c, t, mm]))
        bb.emit_func_output(out)
    return bb.get()


def _run(library):
    mod = _module()
    rng = np.random.default_rng(0)
    args = [tvm.runtime.tensor(rng.standard_normal(s).astype("float32")) for s in [(2, 3, 9, 9), (4, 3, 3, 3), (4, 2, 3, 3), (5, 7)]]
    vm = relax.VirtualMachine(build(mod, resolve_target("CPU"), library=library), tvm.cpu())
    return [o.numpy() for o in vm["main"](*args)]


def test_pass_rewrites_heavy_ops():
    text = library_dispatch(_module()).script()
    for name in ("conv2d", "conv2d_transpose", "matmul"):
        assert f'"ratex.lib.{name}"' in text
    assert "R.nn.conv2d(" not in text


def test_library_matches_tvm_generated_code():
    for got, want in zip(_run(library=True), _run(library=False)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
