"""Fused-loop indices that TVM's FlattenBuffer would compute wrong (tvm_lowering/fused_indices.py).

TVM's IterMapSimplify rewrites `(x % K + c) // d` (d dividing K) as `(x + c) % K // d`, wrong where
x % K + c wraps past K. A GPU schedule fuses every kernel's loops, so the gradient of a strided
slice read its input one row off on an H100. These tests check the rewrite of the bindings, and
run the kernels of a step as the GPU pipeline schedules them, with their thread loops made serial,
on the CPU (scripts/kernel_check.py --gpu-on-cpu): FlattenBuffer runs there as on the GPU.
"""
import os
import sys

import pytest
import tvm
from tvm import tirx
from tvm.sym.iter_affine_map import iter_map_simplify
from tvm.sym.analyzer import Analyzer

from tvm_lowering import fused_indices, pipeline

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import kernel_check  # noqa: E402


def _value(expr, x, v):
    a = Analyzer()
    a.bind(x, tvm.ir.Range(tirx.const(v, "int64"), tirx.const(v + 1, "int64")))
    return int(a.simplify(expr))


def test_tvms_iter_map_gets_an_offset_split_wrong():
    """The TVM behaviour the workaround exists for: where this starts to fail, TVM is fixed and
    fused_indices.py can go."""
    x = tirx.Var("x", "int64")
    c = lambda v: tirx.const(v, "int64")  # noqa: E731
    expr = tirx.floordiv(tirx.floormod(x, c(6)) + c(1), c(2))
    simplified = iter_map_simplify([expr], {x: tvm.ir.Range(c(0), c(12))})[0]
    wrong = [v for v in range(12) if _value(simplified, x, v) != (v % 6 + 1) // 2]
    assert wrong == [5, 11], simplified
    # the form the guard writes is left alone and stays right
    guarded = tirx.floordiv(x - tirx.floordiv(x, c(6)) * c(6) + c(1), c(2))
    kept = iter_map_simplify([guarded], {x: tvm.ir.Range(c(0), c(12))})[0]
    assert [_value(kept, x, v) for v in range(12)] == [(v % 6 + 1) // 2 for v in range(12)]


_KERNEL = """
@T.prim_func(private=True, s_tir=True)
def main(g: T.Buffer((T.int64(2), T.int64(3)), "float32"), out: T.Buffer((T.int64(2), T.int64(6)), "float32")):
    for b in T.thread_binding(T.int64(2), thread="blockIdx.x"):
        for o in range(T.int64(2)):
            for t in T.thread_binding(T.int64(3), thread="threadIdx.x"):
                with T.sblock("out"):
                    v0 = T.axis.spatial(T.int64(2), b)
                    v1 = T.axis.spatial(T.int64(6), {v1})
                    T.reads(g[v0, T.int64(0):T.int64(3)])
                    T.writes(out[v0, v1])
                    out[v0, v1] = T.if_then_else(T.int64(1) <= v1, g[v0, {read}], T.float32(0.0))
"""

# (v1's binding, each o * 3 + t: in the second and third, % binds tighter than the sum around it,
# which the rewrite must keep; g's index at v1; whether the kernel is at risk)
_CASES = [
    ("(b * T.int64(6) + o * T.int64(3) + t) % T.int64(6)", "(v1 - T.int64(1)) // T.int64(2)", True),
    ("o * T.int64(3) + (b * T.int64(3) + t) % T.int64(3)", "(v1 - T.int64(1)) // T.int64(2)", True),
    ("o * T.int64(3) + (b * T.int64(3) + t) % T.int64(3)", "(T.int64(5) + v1) // T.int64(2) - T.int64(3)", True),
    ("(b * T.int64(6) + o * T.int64(3) + t) % T.int64(6)", "v1 // T.int64(2)", False),  # no constant in the sum
]


@pytest.mark.parametrize("v1, read, risky", _CASES)
def test_guarded_bindings_keep_their_values(v1, read, risky):
    import numpy as np  # noqa: PLC0415

    text = _KERNEL.format(v1=v1, read=read)
    assert fused_indices.at_risk(text) is risky
    g = np.arange(6, dtype="float32").reshape(2, 3) + 1
    want = np.zeros((2, 6), "float32")
    for i in range(2):
        for j in range(6):
            k = (j - 1) // 2 if "v1 - " in read or "+ v1" in read else j // 2
            want[i, j] = g[i, k] if j >= 1 else 0
    for source in (fused_indices.guarded(text), text):
        kernel = kernel_check.serial(tvm.script.from_source(source))
        run = tvm.compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), target="llvm")["main"]
        out = tvm.runtime.tensor(np.zeros((2, 6), "float32"))
        run(tvm.runtime.tensor(g), out)
        np.testing.assert_array_equal(out.numpy(), want)


@pytest.mark.parametrize("model, mode", [("stack", "script"), ("stack", "lazy"), ("lenet-b1", "lazy"), ("gpt2l-b8", "script")])
def test_gpu_scheduled_kernels_compute_what_their_rules_write(model, mode, monkeypatch):
    from ratex import config  # noqa: PLC0415

    monkeypatch.setattr(config, "NATIVE_RUNNER", False)  # programs run through Program.run, which the check records
    monkeypatch.setattr(config, "ASYNC", False)
    programs = kernel_check.run_step(model, mode, -1)
    assert programs
    for program, _, _ in programs:
        checked, bad, skipped = kernel_check.check_gpu_schedules(program.mod)
        assert checked >= 5 and bad == [] and skipped == [], (bad, skipped)


def test_without_the_guard_the_stacks_gradient_kernel_is_wrong(monkeypatch):
    """The check above can fail: with the guard taken out, the strided slices' gradient kernel
    reads one row off, as it did on the H100."""
    from ratex import config  # noqa: PLC0415

    monkeypatch.setattr(config, "NATIVE_RUNNER", False)
    monkeypatch.setattr(config, "ASYNC", False)
    from ratex.core import sync  # noqa: PLC0415

    monkeypatch.setattr(pipeline, "guard_fused_indices",
                        tvm.transform.module_pass(lambda mod, _ctx: mod, opt_level=0, name="RatexGuardFusedIndices"))
    sync.reset_cache()
    try:
        (program, _, _), = kernel_check.run_step("stack", "script", -1)
        _, bad, _ = kernel_check.check_gpu_schedules(program.mod)
    finally:
        sync.reset_cache()  # the step's program, built without the guard, must not serve later tests
        # (on a GPU test_jit.py's test_scripted_stack[-1] met it in the same worker and failed)
    assert [name for name, _, _ in bad] and all("pad" in name and "strided_slice" in name for name, _, _ in bad), bad
