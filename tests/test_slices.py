"""slices.py: slices of one tensor that differ only in their offsets share one kernel (CPU)."""
import pytest
import torch
import tvm
from tvm import relax, tirx

from tvm_lowering import build, pipeline, resolve_target

pytestmark = pytest.mark.cpu_only("the CPU target's legalization")

CPU = resolve_target("CPU")
STEPS = 6


def _module():
    """main(x) = (x[0], ..., x[5] as (1, 3, 4) slices, x[:, 1:3] along axis 1 twice, exp(x[2])):
    the steps' slices are kernels of their own, the exp one fused."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((STEPS, 3, 4), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            outs = [bb.emit(relax.op.strided_slice(x, axes=[0], begin=[t], end=[t + 1])) for t in range(STEPS)]
            outs += [bb.emit(relax.op.strided_slice(x, axes=[1], begin=[b], end=[b + 2])) for b in (0, 1)]
            outs.append(bb.emit(relax.op.exp(relax.op.strided_slice(x, axes=[0], begin=[-4], end=[-3]))))
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


def test_slices_at_many_offsets_share_a_kernel_and_compute_what_torch_does():
    with CPU.tvm:
        lowered = tvm.transform.Sequential(pipeline._passes(CPU, CPU.options()))(_module())
    kernels = sorted(gv.name_hint for gv, f in lowered.functions.items() if isinstance(f, tirx.PrimFunc))
    # one kernel for the six steps, one for the two column slices, the fused exp's own
    assert len(kernels) == 3 and sum(name.startswith("strided_slice_at") for name in kernels) == 2, kernels
    x = torch.randn(STEPS, 3, 4)
    got = [torch.from_dlpack(t) for t in relax.VirtualMachine(build(_module(), CPU), tvm.cpu())["main"](x)]
    want = [x[t:t + 1] for t in range(STEPS)] + [x[:, 0:2], x[:, 1:3], x[2:3].exp()]
    for g, w in zip(got[:-1], want[:-1]):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    torch.testing.assert_close(got[-1], want[-1])  # exp: within float rounding


def test_gpu_slices_keep_tvms_kernels():
    target = resolve_target("GPU", "sm_90")
    with target.tvm:
        lowered = tvm.transform.Sequential(pipeline._passes(target, target.options()))(_module())
    assert not any(gv.name_hint.startswith("strided_slice_at") for gv in lowered.get_global_vars())
