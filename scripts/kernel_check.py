"""Kernel by kernel: does each compiled kernel of a training step compute what its rule wrote?

    python scripts/kernel_check.py stack                      # a model of tests/test_jit.py, scripted
    RATEX_DEVICE=GPU python scripts/kernel_check.py stack --dim 0 --out DIR
    python scripts/kernel_check.py lenet-b1 --mode lazy       # a bench model (scripts/bench_models.py)
    python scripts/kernel_check.py gpt2l-b8 --gpu-on-cpu      # its GPU schedules, run serially here

Runs one step of the model on the lazy device (RATEX_DEVICE picks the target; programs run
inline), then replays each program the step ran on the same inputs in a Relax VM whose
instrument copies every kernel's arguments to the host before and after the call. Each kernel
is then built once more from the same module with no schedule at all (tvm_lowering.pipeline.
legalized: the loops as the rule wrote them), for the CPU, and run on the arguments the
compiled kernel got; its outputs must equal the compiled kernel's. A kernel that differs has a
schedule or code generation bug (on the GPU: dlight's rules, DefaultGPUSchedule, NVRTC), and
its TIR, scheduled and not, goes to --out. Library calls (ratex.lib.*, PyTorch's kernels) are
listed, not checked. Floats agree where they differ by at most 1e-5 plus 1e-4 times the output's
largest magnitude (a reduction's order moves every sum by about that), other dtypes exactly.

--gpu-on-cpu needs no GPU: the step runs on the CPU, and each of its kernels, scheduled by the
GPU pipeline with its thread loops made serial, runs on the CPU against its unscheduled self on
random arguments (integers 0, so that indices stay in range). That checks GPU schedules and
TVM's lowering passes, which are the same on both (FlattenBuffer's index bug was one), but not
NVRTC or the hardware.

Models: `stack` and `stack-slices` (test_jit.py's _Stack and _StackOfSlices: --dim), any
bench model, whose step is zero_grad, forward, loss, backward and the optimizer step, or a zoo
model (`zoo:gptj`), whose step is its loss's backward and an SGD step.
"""
import argparse
import os
import re
import sys

os.environ.setdefault("RATEX_ASYNC", "0")  # programs run on this thread, through Program.run
os.environ.setdefault("RATEX_NATIVE_RUNNER", "0")
os.environ.setdefault("RATEX_CACHE_DIR", "")  # programs compiled here keep their module, which the check rebuilds

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ratex  # noqa: E402
import ratex.lazy_tensor_core.core.lazy_model as lm  # noqa: E402
import tvm  # noqa: E402
from ratex.core import executor  # noqa: E402
from ratex.core.device import backend  # noqa: E402
from tvm import relax  # noqa: E402
from tvm_lowering import pipeline  # noqa: E402


class Stack(nn.Module):
    """GPT-J's rotate_every_two with a linear layer before it (tests/test_jit.py's _Stack)."""

    def __init__(self, dim, linear=True):
        super().__init__()
        self.fc = nn.Linear(6, 6) if linear else nn.Identity()
        self.dim = dim

    def forward(self, x):
        h = self.fc(x)
        return torch.stack((-h[:, 1::2], h[:, ::2], h[:, :3] * h[:, 3:]), dim=self.dim).flatten(-2)


def run_step(name, mode, dim):
    """Run one step of model `name` on the lazy device; return [(program, inputs, outputs on the host)]
    of the programs it ran."""
    seen = []
    run = executor.Program.run

    def recording(self, inputs):
        outs = run(self, inputs)
        seen.append((self, list(inputs), [_host(o) for o in outs]))
        return outs

    executor.Program.run = recording
    dev = lm.lazy_device()
    torch.manual_seed(0)
    try:
        if name in ("stack", "stack-slices"):
            model = Stack(dim, linear=name == "stack")
            model = (ratex.jit.script(model) if mode == "script" else model).to(dev)
            x = torch.randn(2, 6).to(dev).requires_grad_()
            out = model(x)
            out.backward(torch.linspace(-1, 2, out.numel()).view(out.shape).to(dev))
        elif name.startswith("zoo:"):  # a model of scripts/zoo.py, one SGD step called as its users call it
            import zoo  # noqa: PLC0415

            build, batches = zoo.MODELS[name[4:]]
            model = build().train()
            model = (ratex.jit.script(model) if mode == "script" else model).to(dev)
            opt = torch.optim.SGD(model.parameters(), lr=zoo.LR)
            opt.zero_grad()
            model(**{k: v.to(dev) for k, v in batches()[0].items()}).loss.backward()
            opt.step()
        else:
            from bench_models import MODELS  # noqa: PLC0415

            spec = MODELS[name]
            model = spec.build().train()
            model = (ratex.jit.script(model) if mode == "script" else model).to(dev)
            opt = spec.optimizer(model.parameters())
            x, y = next(iter(spec.batches(1)))
            opt.zero_grad(set_to_none=True)
            spec.loss(model(x.to(dev)), y.to(dev)).backward()
            opt.step()
        lm.mark_step()
        lm.wait_device_ops()
    finally:
        executor.Program.run = run
    return seen


# The build names a kernel after its fused ops and its structural hash (tvm_lowering/codegen.py)
_BUILT_NAME = re.compile(r"_[0-9a-f]{16}(_u[0-9]+)?$")


def _host(arg):
    if isinstance(arg, torch.Tensor):
        return arg.detach().cpu().float().numpy() if arg.dtype == torch.bfloat16 else arg.detach().cpu().numpy()
    return arg.numpy() if isinstance(arg, tvm.runtime.Tensor) else arg


def kernel_calls(program, inputs) -> tuple:
    """([(symbol, arguments before, arguments after)] of each call `program` makes, on the host;
    the program's outputs, on the host)."""
    vm = relax.VirtualMachine(program.executable, program.device)
    calls, before = [], []

    def instrument(_func, symbol, is_before, _ret, *args):
        name = str(symbol)
        if name.startswith("vm.builtin."):
            return 0
        if is_before:
            before.append([_host(a) for a in args])
        else:
            calls.append((name, before.pop(), [_host(a) for a in args]))
        return 0

    vm.set_instrument(instrument)
    outs = vm["main"](*inputs)
    return calls, [_host(o) for o in outs]


def _same(a, b) -> tuple:
    """(equal, largest difference) of two host arrays."""
    if not isinstance(a, np.ndarray):
        return a == b, 0.0
    floating = a.dtype.kind == "f" or str(a.dtype) == "bfloat16"
    a, b = a.astype(np.float64), b.astype(np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf
        gap = np.abs(a - b)
    diff = float(gap[~np.isnan(gap)].max()) if (~np.isnan(gap)).any() else 0.0
    if floating:  # against the largest magnitude: a reduction's order moves its sums by that much
        scale = float(np.abs(b[np.isfinite(b)]).max()) if np.isfinite(b).any() else 0.0
        nans = np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(a[np.isinf(a)], b[np.isinf(b)])
        return nans and diff <= 1e-5 + 1e-4 * scale, diff
    return bool(np.array_equal(a, b)), diff


def check(program, inputs, outs, out_dir) -> tuple:
    """Check every kernel call of `program` against its unscheduled kernel on the CPU; return
    (kernels checked, [(kernel, argument, largest difference)] that differ, library calls). The
    replay, one call at a time, must also give the step's outputs `outs`: where it does not, the
    step's run differed from a replay that waits for each call (an order or stream bug), and
    the outputs that differ are listed as kernel 'output'."""
    if program.mod is None:
        raise RuntimeError("the program came from the disk cache, without its module: run with RATEX_CACHE_DIR=''")
    be = backend()
    options = executor.compile_options(be)
    plain = pipeline.legalized(program.mod, be.target, options)
    kernels = {gv.name_hint: f for gv, f in plain.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}
    built, bad, library, checked = {}, [], [], 0
    calls, replayed = kernel_calls(program, inputs)
    for j, (want, got) in enumerate(zip(outs, replayed)):
        same, diff = _same(got, want)
        if not same:
            bad.append(("output", j, diff))
    for name, before, after in calls:
        func = kernels.get(_BUILT_NAME.sub("", name))
        if func is None:
            library.append(name)
            continue
        if name not in built:
            try:
                built[name] = tvm.compile(tvm.IRModule({name: func.with_attr("global_symbol", name)}), target="llvm")[name]
            except Exception as err:  # noqa: BLE001 - TVM's errors: reported, the other kernels checked
                built[name] = None
                print(f"  {name}: its unscheduled kernel does not build for the CPU ({str(err).strip().splitlines()[-1]})")
        if built[name] is None:
            continue
        args = [tvm.runtime.tensor(a) if isinstance(a, np.ndarray) else a for a in before]
        built[name](*args)
        checked += 1
        for k, (want, got) in enumerate(zip((_host(a) for a in args), after)):
            same, diff = _same(want, got)
            if not same:
                bad.append((name, k, diff))
    if bad and out_dir:
        os.makedirs(out_dir, exist_ok=True)
        scheduled = pipeline.legalized(program.mod, be.target, options, scheduled=True)
        for name in sorted({b[0] for b in bad} - {"output"}):
            base = _BUILT_NAME.sub("", name)
            with open(os.path.join(out_dir, f"{base}.txt"), "w") as f:
                f.write(f"# unscheduled\n{plain[base]}\n\n# scheduled\n{scheduled[base]}\n")
    return checked, bad, library


_THREAD = re.compile(r', thread="[^"]+"')


def serial(func) -> "tvm.tirx.PrimFunc":
    """A GPU-scheduled kernel with its thread-bound loops made serial: the same loops, index
    arithmetic and lowering passes (FlattenBuffer's among them), buildable for the CPU. In the
    scheduled (block) form each stage of a kernel is a loop nest of its own, so running each
    nest's threads one after the other keeps what a stage reads from the stage before."""
    text = _THREAD.sub("", func.script().replace("T.thread_binding(", "T.serial("))
    return tvm.script.from_source(text)


_PARAM = re.compile(r'(\w+): T\.Buffer\(\(((?:[^()]|\([^()]*\))*)\), "(\w+)"')
_DIM = re.compile(r"^(?:T\.int\d+\((\d+)\)|(\d+))$")


def _random_args(func, rng) -> list:
    """Arguments for kernel `func`: floats from a normal distribution, integers 0 (an index in
    range of anything), booleans at random; None for a kernel whose shapes are not constants."""
    head = func.script().split("):\n", 1)[0]
    args = []
    for _name, dims, dtype in _PARAM.findall(head):
        shape = []
        for d in (d.strip() for d in dims.split(",") if d.strip()):
            m = _DIM.match(d)
            if m is None:
                return None
            shape.append(int(m.group(1) or m.group(2)))
        if dtype.startswith("float"):
            data = rng.standard_normal(shape).astype(dtype)
        elif dtype == "bool":
            data = rng.random(shape) < 0.5
        else:
            data = np.zeros(shape, dtype)
        args.append(data)
    return args if len(args) == len(func.params) else None


def check_gpu_schedules(mod, target_name="GPU", arch="sm_90", seed=0, options=None) -> tuple:
    """Check each kernel of Relax module `mod` as the GPU pipeline schedules it (the kernel library
    off, so products and convolutions are TVM's kernels too), made serial and run on the CPU,
    against the same kernel unscheduled, on random arguments; return (kernels checked,
    [(kernel, argument, largest difference)] that differ, kernels skipped). Catches what the
    schedule and TVM's lowering passes get wrong on any machine; not what only a GPU shows (NVRTC,
    the hardware). `options`: other compile options (the target's defaults send products to the
    kernel library)."""
    import tvm_lowering  # noqa: PLC0415

    target = tvm_lowering.resolve_target(target_name, arch)
    options = options if options is not None else tvm_lowering.Options()
    plain = pipeline.legalized(mod, target, options)
    scheduled = pipeline.legalized(mod, target, options, scheduled=True)
    names = {g.name_hint for g in plain.get_global_vars()}
    rng = np.random.default_rng(seed)
    cases, skipped = {}, []  # name -> (unscheduled, serial, arguments)
    for gv, func in scheduled.functions.items():
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        name = gv.name_hint
        args = _random_args(plain[name], rng) if name in names else None
        if args is None:
            skipped.append(name)
            continue
        cases[name] = (plain[name], serial(func), args)
    runs = [_build_all({n: c[0] for n, c in cases.items()}), _build_all({n: c[1] for n, c in cases.items()})]
    checked, bad = 0, []
    for name, (_, _, args) in cases.items():
        outs = []
        for built in runs:
            fn = built.get(name)
            if isinstance(fn, str):
                outs = f"{name} ({fn})"
                break
            tensors = [tvm.runtime.tensor(a.copy()) for a in args]
            fn(*tensors)
            outs.append([t.numpy() for t in tensors])
        if isinstance(outs, str):
            skipped.append(outs)
            continue
        checked += 1
        for k, (want, got) in enumerate(zip(*outs)):
            same, diff = _same(want, got)
            if not same:
                bad.append((name, k, diff))
    return checked, bad, skipped


def _build_all(funcs: dict) -> dict:
    """name -> the CPU function of each kernel of `funcs`, built as one module (one LLVM build is
    much faster than one a kernel); where that fails, each alone, and the error's last line for
    a kernel that does not build."""
    mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
    try:
        lib = tvm.compile(mod, target="llvm")
        return {name: lib[name] for name in funcs}
    except Exception:  # noqa: BLE001 - some kernel does not build: find it by building each alone
        pass
    out = {}
    for name, f in funcs.items():
        try:
            out[name] = tvm.compile(tvm.IRModule({name: f.with_attr("global_symbol", name)}), target="llvm")[name]
        except Exception as err:  # noqa: BLE001 - TVM's errors: the kernel is listed as skipped
            out[name] = str(err).strip().splitlines()[-1][:80]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="stack, stack-slices, a bench model (scripts/bench_models.py) or zoo:NAME (scripts/zoo.py)")
    p.add_argument("--mode", choices=("lazy", "script"), default="script")
    p.add_argument("--dim", type=int, default=-1, help="the stack's dim (stack models)")
    p.add_argument("--out", default="", help="a folder for the TIR of kernels that differ")
    p.add_argument("--gpu-on-cpu", action="store_true",
                   help="check the step's kernels as the GPU pipeline schedules them, made serial, on the CPU "
                        "(random arguments): no GPU needed")
    args = p.parse_args()
    programs = run_step(args.model, args.mode, args.dim)
    if args.gpu_on_cpu:
        failed = False
        for k, (program, _, _) in enumerate(programs):
            checked, bad, skipped = check_gpu_schedules(program.mod)
            print(f"program {k}, scheduled for the GPU, run serially on the CPU: {checked} kernels checked, "
                  f"{len(bad)} outputs differ, {len(skipped)} skipped (symbolic shapes, or no CPU build)")
            for name, arg, diff in bad:
                print(f"  DIFFERS  {name}  argument {arg}  largest difference {diff:.3g}")
            if skipped:
                print(f"  skipped: {', '.join(skipped)}")
            failed |= bool(bad)
        sys.exit(1 if failed else 0)
    print(f"{args.model} ({args.mode}) on {os.environ.get('RATEX_DEVICE', 'CPU')}: {len(programs)} program(s)")
    failed = False
    for k, (program, inputs, outs) in enumerate(programs):
        checked, bad, library = check(program, inputs, outs, args.out)
        print(f"program {k}: {checked} kernel calls checked, {len(bad)} outputs differ; "
              f"library calls: {', '.join(sorted(set(library))) or 'none'}")
        for name, arg, diff in bad:
            print(f"  DIFFERS  {name}  argument {arg}  largest difference {diff:.3g}")
        failed |= bool(bad)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
