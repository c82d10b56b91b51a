"""concat.py: concatenations and stacks of many tensors as one copy loop per tensor on the CPU."""
import pytest
import torch
import tvm
from tvm import relax, tirx

from tvm_lowering import build, codegen, concat, pipeline, resolve_target

pytestmark = pytest.mark.cpu_only("the CPU target's legalization")

CPU = resolve_target("CPU")


def _module(shapes, how, axis, scale=False):
    bb = relax.BlockBuilder()
    xs = [relax.Var(f"x{k}", relax.TensorType(shape, "float32")) for k, shape in enumerate(shapes)]
    with bb.function("main", xs):
        with bb.dataflow():
            out = bb.emit(getattr(relax.op, how)(relax.Tuple(xs), axis=axis))
            if scale:
                out = bb.emit(relax.op.multiply(out, relax.const(2.0, "float32")))
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    return bb.get()


def _kernels(mod):
    with CPU.tvm:
        lowered = tvm.transform.Sequential(pipeline._passes(CPU, CPU.options()))(mod)
    return {gv.name_hint: f for gv, f in lowered.functions.items() if isinstance(f, tirx.PrimFunc)}


def _run(mod, xs):
    vm = relax.VirtualMachine(build(mod, CPU), tvm.cpu())
    return torch.from_dlpack(vm["main"](*xs))


@pytest.mark.parametrize("how, axis", [("concat", 1), ("concat", -1), ("stack", 0), ("stack", 2), ("stack", -1)])
def test_many_tensors_are_copied_into_place(how, axis):
    many = concat.MANY + 1
    # concat: different widths along the axis
    shapes = [(3, k % 3 + 1, 5) if how == "concat" and axis == 1 else (3, 4, k % 3 + 1) for k in range(many)]
    if how == "stack":
        shapes = [(3, 4, 5)] * many
    xs = [torch.randn(shape) for shape in shapes]
    want = torch.cat(xs, axis) if how == "concat" else torch.stack(xs, axis)
    torch.testing.assert_close(_run(_module(shapes, how, axis), xs), want, rtol=0, atol=0)
    kernels = _kernels(_module(shapes, how, axis))
    assert list(kernels) and all(name.startswith(f"{how}_copies") for name in kernels)
    assert not any(codegen._branching(f) for f in kernels.values())  # built in parallel, no LLVM options


def test_few_tensors_keep_tvms_kernel_which_fuses():
    shapes = [(3, 4)] * (concat.MANY - 1)
    kernels = _kernels(_module(shapes, "concat", 0, scale=True))
    assert len(kernels) == 1 and "copies" not in next(iter(kernels))  # the concat fused with the multiply
    xs = [torch.randn(shape) for shape in shapes]
    torch.testing.assert_close(_run(_module(shapes, "concat", 0, scale=True), xs), torch.cat(xs) * 2)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_a_split_into_many_parts_is_copied_out(axis):
    many, shape = concat.MANY + 1, [3, 4, 5]
    shape[axis] = many * 2
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            parts = bb.emit(relax.op.split(x, many, axis=axis))
            out = bb.emit_output(relax.Tuple([relax.TupleGetItem(parts, k) for k in range(many)]))
        bb.emit_func_output(out)
    mod = bb.get()
    xt = torch.randn(shape)
    got = relax.VirtualMachine(build(mod, CPU), tvm.cpu())["main"](xt)
    for g, w in zip(got, torch.chunk(xt, many, axis)):
        torch.testing.assert_close(torch.from_dlpack(g), w, rtol=0, atol=0)
    kernels = _kernels(mod)
    assert list(kernels) == [next(name for name in kernels if name.startswith("split_copies"))]


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float16, torch.bfloat16], ids=str)
def test_copies_of_other_dtypes(dtype):
    many = concat.MANY
    xs = [(torch.randn(2, 3) > 0).to(dtype) for _ in range(many)]
    bb = relax.BlockBuilder()
    vs = [relax.Var(f"x{k}", relax.TensorType((2, 3), str(dtype).split(".")[1])) for k in range(many)]
    with bb.function("main", vs):
        with bb.dataflow():
            out = bb.emit_output(relax.op.stack(relax.Tuple(vs), axis=1))
        bb.emit_func_output(out)
    assert torch.equal(_run(bb.get(), xs), torch.stack(xs, 1))
    copied = any(name.startswith("stack_copies") for name in _kernels(bb.get()))
    assert copied == (dtype != torch.bfloat16)  # bfloat16 keeps TVM's kernel (concat._COPYABLE)
