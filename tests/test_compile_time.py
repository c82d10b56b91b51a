"""What makes a cold compile cheaper: kernels without the argument checks the VM makes itself,
built on threads, and kernels, schedules and legalizations shared by a process's programs."""
import collections
import dataclasses

import pytest
import torch
import tvm
import tvm_ffi
from tvm import relax, tirx

from tvm_lowering import build, codegen, legalize, once, pipeline, resolve_target, schedules

pytestmark = pytest.mark.cpu_only("LLVM code generation")

CPU = resolve_target("CPU")
F32 = "float32"


def _module(shape=(4, 8), extra=False):
    """main(x, y) = (sum((x + y) * x, axis 1), exp(x) - y[, tanh(y) * y with `extra`]): a kernel each."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, F32))
    y = relax.Var("y", relax.TensorType(shape, F32))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            outs = [bb.emit(relax.op.sum(relax.op.multiply(relax.op.add(x, y), x), axis=[1])),
                    bb.emit(relax.op.subtract(relax.op.exp(x), y))]
            if extra:
                outs.append(bb.emit(relax.op.multiply(relax.op.tanh(y), y)))
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


def _expected(x, y, extra=False):
    return [((x + y) * x).sum(1), x.exp() - y] + ([y.tanh() * y] if extra else [])


def _run(executable, *args):
    return [torch.from_dlpack(t) for t in relax.VirtualMachine(executable, tvm.cpu())["main"](*args)]


@pytest.fixture(scope="module")
def program():
    """The executable of _module() and the kernels of its TIR, through ratex's pipeline."""
    return build(_module(), CPU)


def _checks(mod: tvm.IRModule) -> collections.Counter:
    """What the prologue checks of the packed kernels in `mod` check, counted."""
    found = collections.Counter()

    def walk(stmt):
        kind = type(stmt)
        if kind is tirx.AssertStmt:
            text = codegen._text(stmt)
            found[next((what for what in ("strides", "byte_offset", "device_type", "shape", "ndim", "dtype")
                        if what in text), "other")] += 1
        elif kind is tirx.SeqStmt:
            for s in stmt.seq:
                walk(s)
        elif kind is tirx.AttrStmt and stmt.attr_key != "compute_scope":
            walk(stmt.body)
        elif kind is tirx.IfThenElse:
            walk(stmt.then_case)

    for func in mod.functions.values():
        walk(func.body)
    return found


def _lowered_kernels(pipeline_name: str) -> tvm.IRModule:
    passes = tvm.transform.Sequential(pipeline._passes(CPU, CPU.options()))
    with CPU.tvm:
        mod = passes(_module())
    kernels = tvm.IRModule({gv: f for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)})
    kernels = tirx.transform.BindTarget(CPU.tvm.with_host(CPU.tvm))(kernels)
    lower, _, _ = tvm.tirx.get_tir_pipeline(pipeline_name)
    with CPU.tvm:
        return lower(kernels)


def test_kernels_keep_only_the_argument_checks_the_vm_does_not_make():
    default, trimmed = _checks(_lowered_kernels("default")), _checks(_lowered_kernels(codegen.PIPELINE))
    for made_by_the_vm in ("shape", "ndim", "dtype"):
        assert default[made_by_the_vm] and not trimmed[made_by_the_vm]
    for kept in ("strides", "byte_offset", "device_type"):
        assert trimmed[kept] == default[kept] > 0


def test_a_program_still_rejects_inputs_that_do_not_match(program):
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    torch.testing.assert_close(_run(program, x, y), _expected(x, y))
    with pytest.raises(ValueError, match="compact"):  # a kernel's own check, kept
        _run(program, torch.randn(8, 4).t(), y)
    with pytest.raises(Exception, match="shape"):  # the VM's
        _run(program, torch.randn(4, 9), y)
    with pytest.raises(Exception, match="dtype"):
        _run(program, torch.randn(4, 8, dtype=torch.float64), y)


def test_kernels_are_split_over_threads_each_once():
    mod = tvm.IRModule({gv: f for gv, f in _lowered_kernels(codegen.PIPELINE).functions.items()})
    shards = codegen._shards(mod, 2)
    names = [gv.name_hint for shard in shards for gv in shard.get_global_vars()]
    assert len(shards) == 2 and sorted(names) == sorted(gv.name_hint for gv in mod.get_global_vars())


# An llvm target without command-line options: its kernels may be built on several threads.
PLAIN_LLVM = dataclasses.replace(CPU, tvm=tvm.target.Target({"kind": "llvm"}))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_program_built_on_threads_computes_what_torch_does(threads, monkeypatch):
    monkeypatch.setattr(codegen, "cores", lambda: threads)
    monkeypatch.setattr(codegen, "KERNELS", codegen.KernelCache())  # built here whatever ran before
    executable = build(_module(extra=True), PLAIN_LLVM)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    torch.testing.assert_close(_run(executable, x, y), _expected(x, y, extra=True))


def _concat_module():
    """main(x, y) = (concat([x, y], axis 1) * 2, exp(x) - y): a kernel that branches (the concat's
    if_then_else) and one that does not."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), F32))
    y = relax.Var("y", relax.TensorType((4, 8), F32))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            two = relax.const(2.0, F32)
            outs = [bb.emit(relax.op.multiply(relax.op.concat([x, y], axis=1), two)),
                    bb.emit(relax.op.subtract(relax.op.exp(x), y))]
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("jit", [True, False])
def test_only_kernels_that_branch_are_built_with_the_targets_llvm_options(jit, monkeypatch, tmp_path):
    """LLVM's command-line options are process-wide, and TVM sets a target's `cl-opt` around each
    build and puts back what it found: on two threads at once, the CPU target's
    -enable-if-conversion=false was off mid-build now and then (a slice_scatter miscompiled, and
    a tiny GPT-J trained to NaN). The option changes only loops that branch: the other kernels
    are built without it, on any thread, and those that branch with it, under one lock."""
    builds = []
    real = tvm.tirx.build

    def spy(mod, target=None, pipeline=None):
        names = sorted(gv.name_hint for gv in mod.get_global_vars())
        options = bool(target.attrs.get("cl-opt"))
        builds.append((names, options, options and codegen.LLVM_OPTIONS.locked()))
        return real(mod, target=target, pipeline=pipeline)

    monkeypatch.setattr(tvm.tirx, "build", spy)
    monkeypatch.setattr(codegen, "cores", lambda: 2)
    monkeypatch.setattr(codegen, "KERNELS", codegen.KernelCache())
    executable = build(_concat_module(), CPU, jit=jit)
    if not jit:
        path = str(tmp_path / "program.so")
        with codegen.LLVM_OPTIONS:
            executable.export_library(path)
        executable = tvm.runtime.load_module(path)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    torch.testing.assert_close(_run(executable, x, y), [torch.cat([x, y], 1) * 2, x.exp() - y])
    with_options = [names for names, options, _ in builds if options]
    assert len(with_options) == 1 and all(held for _, options, held in builds if options)
    assert with_options[0] and all("concatenate" in name for name in with_options[0])
    others = [name for names, options, _ in builds if not options for name in names]
    assert others and not any("concatenate" in name for name in others)


def test_a_kernel_branches_where_its_tir_can():
    with CPU.tvm:
        mod = tvm.transform.Sequential(pipeline._passes(CPU, CPU.options()))(_concat_module())
    kernels = {gv.name_hint: codegen._branching(f) for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)}
    assert sorted(kernels.values()) == [False, True]
    assert all(branches == ("concatenate" in name) for name, branches in kernels.items())


@pytest.fixture
def kernels(monkeypatch):
    """A fresh kernel cache, and the names of the kernels each build made (one list per build)."""
    cache = codegen.KernelCache()
    monkeypatch.setattr(codegen, "KERNELS", cache)
    made = []
    shards = codegen._build_shards

    def spy(mod, *args):
        made.append(sorted(gv.name_hint for gv in mod.get_global_vars()))
        return shards(mod, *args)

    monkeypatch.setattr(codegen, "_build_shards", spy)
    return cache, made


def test_programs_share_the_kernels_they_have_in_common(kernels):
    cache, made = kernels
    first = build(_module(), CPU)
    second = build(_module(extra=True), CPU)  # the first's two kernels, and tanh(y) * y
    other_shape = build(_module(shape=(3, 5)), CPU)  # kernels of the same names, on other shapes
    assert [len(m) for m in made] == [2, 1, 2]
    assert not set(made[2]) & set(made[0])
    assert len(cache) == 5
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    torch.testing.assert_close(_run(first, x, y), _expected(x, y))
    torch.testing.assert_close(_run(second, x, y), _expected(x, y, extra=True))
    a, b = torch.randn(3, 5), torch.randn(3, 5)
    torch.testing.assert_close(_run(other_shape, a, b), _expected(a, b))


def test_an_exported_program_neither_uses_nor_fills_the_kernel_cache(kernels, tmp_path):
    cache, made = kernels
    build(_module(), CPU)
    held = len(cache)
    exported = build(_module(), CPU, jit=False)
    assert len(cache) == held and [len(m) for m in made] == [2, 2]  # built anew
    path = str(tmp_path / "program.so")
    with codegen.LLVM_OPTIONS:
        exported.export_library(path)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    torch.testing.assert_close(_run(tvm.runtime.load_module(path), x, y), _expected(x, y))


def test_a_kernel_name_is_given_to_one_kernel_only(kernels):
    cache, _ = kernels
    with CPU.tvm:
        func, other = (next(f for f in tvm.transform.Sequential(pipeline._passes(CPU, CPU.options()))(_module(shape))
                            .functions.values() if isinstance(f, tirx.PrimFunc)) for shape in ((4, 8), (3, 5)))
    where = (str(CPU.tvm), "")
    name = cache._name(func, "k", where)
    assert cache._name(func, "k", where) == name  # the same kernel: the same name
    assert cache._name(other, "k", where) != name
    assert cache._name(func, "k", ("another target", "")) != name
    twice = tvm.IRModule({tvm.ir.GlobalVar("a"): func, tvm.ir.GlobalVar("b"): func})
    named = cache.name(twice, CPU.tvm)
    assert len({f.attrs["global_symbol"] for f in named.functions.values()}) == 2
    cache.clear()
    assert cache._name(func, "k", where) != name  # a name given out is never given again


def _repeated_adds():
    """main(x, y): five adds of (4, 8) tensors and one of (3, 5) ones."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), F32))
    y = relax.Var("y", relax.TensorType((3, 5), F32))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            z = x
            for _ in range(5):
                z = bb.emit(relax.op.add(z, x))
            w = bb.emit(relax.op.add(y, y))
            out = bb.emit_output(relax.Tuple([z, w]))
        bb.emit_func_output(out)
    return bb.get()


def test_legalization_runs_once_per_distinct_call_and_gives_what_tvm_gives():
    tvm_add = tvm.ir.Op.get("relax.add").get_attr("FLegalize")
    calls = []

    def add(bb, call):
        calls.append(call)
        return tvm_add(bb, call)

    with CPU.tvm:
        ours = legalize.legalize_ops({"relax.add": add})(_repeated_adds())
        assert len(calls) == 2  # one per distinct (types, attributes)
        again = legalize.legalize_ops({"relax.add": add})(_repeated_adds())
        assert len(calls) == 2  # the kernels legalized before, in another module
        theirs = relax.transform.LegalizeOps()(_repeated_adds())
    tvm.ir.assert_structural_equal(ours, theirs)
    tvm.ir.assert_structural_equal(again, theirs)


def test_a_kernel_is_scheduled_once_per_process_as_the_rules_schedule_it():
    memo = once.Once()
    seen = []
    rules = schedules.cpu_schedule()

    @tvm.transform.module_pass(opt_level=0, name="Counted")
    def counted(mod, ctx):
        seen.append(len(mod.functions))
        return rules(mod)

    def fused(shape):
        passes = pipeline._passes(CPU, CPU.options())
        upto = next(k for k, p in enumerate(passes) if p.info.name.startswith("Once("))
        with CPU.tvm:
            return tvm.transform.Sequential(passes[:upto])(_module(shape))

    with CPU.tvm:
        first = memo.wrap(counted, "CPU")(fused((4, 8)))
        second = memo.wrap(counted, "CPU")(fused((4, 8)))
        other = memo.wrap(counted, "CPU")(fused((3, 5)))
        plain = rules(fused((4, 8)))
    assert len(seen) == 2 and seen[0] == seen[1] > 0  # not called for the second module
    tvm.ir.assert_structural_equal(first, plain)
    tvm.ir.assert_structural_equal(second, plain)
    assert not tvm_ffi.structural_equal(other, plain)


def test_metrics_split_a_compile_into_its_pass_pipeline_and_its_code_generation(dev):
    from ratex.lazy_tensor_core.core import lazy_model as lm
    from ratex.lazy_tensor_core.debug import metrics

    x = torch.randn(3, 7)
    y = (x.to(dev) * 3 + 1).tanh().sum(0)
    lm.mark_step()
    torch.testing.assert_close(y.cpu(), (x * 3 + 1).tanh().sum(0))
    compiled = metrics.metric_data("CompileTime")
    passes, codegen_ = metrics.metric_data("CompilePassesTime"), metrics.metric_data("CodegenTime")
    assert compiled[0] == passes[0] == codegen_[0] == 1
    assert 0 < passes[1] and 0 < codegen_[1] and passes[1] + codegen_[1] <= compiled[1]


def test_metrics_keep_the_seconds_aotautograd_takes(dev):
    from ratex.lazy_tensor_core.debug import metrics

    def f(a):
        return (a.sin() * 2).sum()

    x = torch.randn(5)
    got = torch.compile(f, backend="ratex")(x)
    torch.testing.assert_close(got, f(x))
    assert metrics.metric_data("CaptureTime")[0] == 1


def _fills():
    """main(x) = the fills legalize.py makes constants, and two it leaves to run time, each added
    to x's first element so that none is dead."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 3), F32))
    with bb.function("main", [x]):
        with bb.dataflow():
            fills = [
                relax.op.broadcast_to(relax.const(float("-inf"), F32), (2, 3)),
                relax.op.broadcast_to(relax.const([1.5, -2.0, 0.25], F32), (4, 3)),
                relax.op.ones(relax.ShapeExpr(()), F32),
                relax.op.zeros(relax.ShapeExpr((5,)), "int64"),
                relax.op.ones_like(x),
                relax.op.full((3, 2), relax.const(7, "int32"), "int32"),
                relax.op.full_like(x, relax.const(2.5, F32)),
                relax.op.zeros(relax.ShapeExpr((2, 2)), "bool"),
                relax.op.broadcast_to(relax.const(0.5, "float16"), (2, 2)),
                relax.op.broadcast_to(relax.const(3.0, F32), ()),
                # at run time: a zeros of more than FoldConstant's 1024 elements, a fill of x
                relax.op.zeros(relax.ShapeExpr((33, 32)), F32),
                relax.op.broadcast_to(relax.op.strided_slice(x, [0, 1], [0, 0], [1, 1]), (2, 3)),
            ]
            out = bb.emit_output(relax.Tuple([bb.emit(f) for f in fills]))
        bb.emit_func_output(out)
    return bb.get()


def test_constant_fills_become_constants_without_a_kernel_and_keep_their_values():
    with CPU.tvm:
        lowered = legalize.legalize_ops({})(_fills())
    kernels = [b.value for b in lowered["main"].body.blocks[0].bindings
               if isinstance(b.value, relax.Call) and b.value.op.same_as(legalize._CALL_TIR)]
    assert len(kernels) == 3, lowered["main"]  # the large zeros; the slice of x and its fill
    x = torch.randn(2, 3)
    got = _run(build(_fills(), CPU), x)
    inf = float("-inf")
    expected = [torch.full((2, 3), inf), torch.tensor([1.5, -2.0, 0.25]).expand(4, 3), torch.ones(()),
                torch.zeros(5, dtype=torch.int64), torch.ones(2, 3), torch.full((3, 2), 7, dtype=torch.int32),
                torch.full((2, 3), 2.5), torch.zeros(2, 2, dtype=torch.bool),
                torch.full((2, 2), 0.5, dtype=torch.float16), torch.tensor(3.0), torch.zeros(33, 32), x[0, 0].expand(2, 3)]
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_cpu_programs_skip_fold_constant_and_gpu_programs_keep_it():
    names = {p.info.name for p in pipeline._passes(CPU, CPU.options())}
    assert "FoldConstant" not in names and "FuseOps" in names
    gpu = resolve_target("GPU", "sm_90")
    assert "FoldConstant" in {p.info.name for p in pipeline._passes(gpu, gpu.options())}


def test_dead_bindings_are_dropped_as_tvm_drops_them():
    """simplify.drop_dead_bindings gives what TVM's DeadCodeElimination gives: the dataflow
    bindings that nothing reads (a chain of them too) gone, the rest as they were."""
    from tvm_lowering.simplify import drop_dead_bindings

    def module():
        bb = relax.BlockBuilder()
        x = relax.Var("x", relax.TensorType((4, 8), F32))
        with bb.function("main", [x]):
            with bb.dataflow():
                a = bb.emit(relax.op.exp(x))
                dead = bb.emit(relax.op.permute_dims(a))
                bb.emit(relax.op.tanh(dead))  # dead too, once its user is
                b = bb.emit(relax.op.add(a, x))
                out = bb.emit_output(relax.op.sum(b, axis=[1]))
            bb.emit_func_output(out)
        return bb.get()

    ours = drop_dead_bindings(module())
    tvm.ir.assert_structural_equal(ours, relax.transform.DeadCodeElimination()(module()))
    assert len(ours["main"].body.blocks[0].bindings) == 3
    kept = drop_dead_bindings(ours)
    assert kept.same_as(ours)  # nothing left to drop: the module itself
