"""Kernel by kernel: what one training step's compiled program runs, against eager PyTorch's ops.

    python scripts/kernel_profile.py mlp-b128 [--modes eager,lazy,script,compile] [--repeats 10] [--top 15]

Each mode trains one bench model (scripts/bench_models.py) in a fresh process, one torch/TVM
thread, ENABLE_PARAM_ALIASING=true and no disk cache, as scripts/bench.py does, for --warmup
steps. Then:
- eager: torch.profiler over --repeats more steps; each ATen op's self CPU time per step.
- lazy, script: the step's program (the largest one compiled) runs --repeats more times on the
  last step's inputs in a Relax VM with an instrument that times every call it makes: each
  TVM kernel, each `ratex.lib.*` library call (PyTorch's kernels: the generic `aten_out` call
  is named by the ATen op it runs) and the VM's builtins (allocation, tuple access).
- compile: torch.compile(step, backend="ratex"); each program the step runs (forward, backward,
  optimizer step) runs --repeats more times on its last inputs, timed as above and summed.

Printed per mode: ms per step of the program run whole (lazy, script: without the instrument;
eager: a step without the profiler), wall and CPU time, the sum of the timed calls split into GEMM
(mm, addmm, bmm, matmul, convolutions: PyTorch's kernels in both systems, MKL's sgemm in eager's
and, for large float32 products, oneDNN's in ratex's native kernels) and the rest, then the --top
calls by time per step. ratex's calls are timed in CPU time of the thread running the program
(a busy machine inflates wall time), eager's ops in torch.profiler's wall time. The instrument costs a few µs a call, so ratex's sum exceeds the
whole run by about that times the calls per step. Eager's fused attention
(_scaled_dot_product_flash_attention_for_cpu and its backward) does its own products inside and
counts as "other"; ratex's lazy path computes attention as bmm + softmax, whose bmm are GEMM.
"""
import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time

MODES = ("eager", "lazy", "script", "compile")
# PyTorch's GEMM and convolution kernels: eager's ATen ops, ratex's library calls of them.
GEMM = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mkldnn_convolution",
        "aten::convolution_backward", "ratex.lib.mm_out", "ratex.lib.addmm_out", "ratex.lib.bmm_out",
        "ratex.lib.matmul_out", "ratex.lib.convolution", "ratex.lib.convolution_backward", "ratex.lib.conv2d",
        "ratex.lib.conv2d_transpose", "ratex.lib.conv2d_weight_grad"}


def _setup(model_name, mode, warmup):
    """(model, optimizer, spec, batches, device, mark, wait) after `warmup` training steps."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    from bench_models import MODELS, POOL

    torch.set_num_threads(1)
    spec = MODELS[model_name]
    torch.manual_seed(0)
    batches = spec.batches(1)
    model = spec.build()
    if mode in ("eager", "compile"):
        dev, mark, wait = torch.device("cpu"), (lambda: None), (lambda: None)
    else:
        import ratex
        import ratex.lazy_tensor_core.core.lazy_model as lm

        dev, mark, wait = lm.lazy_device(), lm.mark_step, lm.wait_device_ops
        if mode == "script":
            model = ratex.jit.script(model)
    model.to(dev)
    model.train()
    opt = spec.optimizer(model.parameters())

    def step(i):
        x, y = batches[i % POOL]
        x, y = x.to(dev), y.to(dev)
        opt.zero_grad()
        loss = spec.loss(model(x), y)
        loss.backward()
        opt.step()
        mark()
        return loss

    if mode == "compile":
        import ratex  # noqa: F401  (registers the "ratex" backend)

        step = torch.compile(step, backend="ratex")
    for i in range(warmup):
        loss = step(i)
    wait()
    return step, wait, loss


def profile_eager(model_name, warmup, repeats):
    """{name: ms per step} of each ATen op's self CPU time, and the unprofiled step's ms."""
    import torch

    step, _, _ = _setup(model_name, "eager", warmup)
    walls, cpus = [], []
    for i in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        step(warmup + i)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for i in range(repeats):
            step(warmup + repeats + i)
    calls = {}
    for event in prof.key_averages():
        if event.self_cpu_time_total > 0:
            calls[event.key] = (event.self_cpu_time_total / 1e3 / repeats, event.count / repeats)
    return {"whole_ms": statistics.median(walls) * 1e3, "whole_cpu_ms": statistics.median(cpus) * 1e3, "calls": calls}


def _programs(model_name, mode, warmup):
    """[(executable, device, inputs)] of the programs one training step runs, on their last inputs."""
    if mode == "compile":
        import tvm
        from ratex.dynamo import program

        libs, seen = [], {}
        find, make, run = program.CompiledGraph._program, program.CompiledGraph._region, program.Region.run

        def finding(self, *args, **kwargs):
            libs.append(find(self, *args, **kwargs))
            return libs[-1]

        def making(self, *args, **kwargs):
            region = make(self, *args, **kwargs)
            region.profiled_lib = libs[-1]
            return region

        def recording(self, xs):
            seen[id(self)] = (self.profiled_lib, list(xs))
            return self._call(xs)

        program.CompiledGraph._program, program.CompiledGraph._region = finding, making
        program.Region.run = recording
        _setup(model_name, mode, warmup)
        program.CompiledGraph._program, program.CompiledGraph._region, program.Region.run = find, make, run
        return [(lib, tvm.cpu(), xs) for lib, xs in seen.values()]
    from ratex.core import executor

    seen = {}
    run = executor.Program.run

    def recording(self, inputs):
        seen[id(self)] = (self, list(inputs))
        return run(self, inputs)

    executor.Program.run = recording
    _, wait, _ = _setup(model_name, mode, warmup)
    wait()
    executor.Program.run = run
    if not seen:
        raise RuntimeError("no program ran: is RATEX_NATIVE_RUNNER off in this process?")
    program, inputs = max(seen.values(), key=lambda pi: len(pi[1]))
    return [(program.executable, program.device, inputs)]


def profile_ratex(model_name, mode, warmup, repeats):
    """{name: ms per step} of each call the step's programs make, and the programs' ms run whole."""
    from tvm import relax

    progs = _programs(model_name, mode, warmup)
    fns = [(relax.VirtualMachine(lib, dev), xs) for lib, dev, xs in progs]
    walls, cpus = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.thread_time()
        for vm, xs in fns:
            vm["main"](*xs)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.thread_time() - c0)
    times = collections.defaultdict(list)  # name -> seconds of each call, all runs together
    started = []
    clock = time.thread_time  # the program runs on this thread: CPU time, which a busy machine inflates less

    def instrument(func, symbol, before, _ret, *args):
        if before:
            started.append(clock())
            return 0
        elapsed = clock() - started.pop()
        name = str(symbol)
        if name == "ratex.lib.aten_out":
            name += f"[{json.loads(str(args[-2]))['op']}]"
        times[name].append(elapsed)
        return 0

    for vm, _ in fns:
        vm.set_instrument(instrument)
    for _ in range(repeats):
        for vm, xs in fns:
            vm["main"](*xs)
    calls = {name: (sum(ts) * 1e3 / repeats, len(ts) / repeats) for name, ts in times.items()}
    return {"whole_ms": statistics.median(walls) * 1e3, "whole_cpu_ms": statistics.median(cpus) * 1e3, "calls": calls}


def _report(mode, r, top):
    calls = r["calls"]
    gemm = sum(ms for name, (ms, _) in calls.items() if name in GEMM)
    total = sum(ms for ms, _ in calls.values())
    print(f"\n{mode}: {r['whole_ms']:.2f} ms/step run whole ({r['whole_cpu_ms']:.2f} ms CPU); timed calls {total:.2f} ms = "
          f"GEMM {gemm:.2f} + other {total - gemm:.2f}")
    print(f"  {'ms/step':>8} {'calls':>6}  name")
    for name, (ms, n) in sorted(calls.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {ms:8.3f} {n:6.0f}  {name}{'  (GEMM)' if name in GEMM else ''}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a model of scripts/bench_models.py, e.g. mlp-b128")
    parser.add_argument("--modes", default="eager,lazy,script", help=f"comma-separated: {','.join(MODES)}")
    parser.add_argument("--warmup", type=int, default=5, help="training steps before profiling (compiles happen here)")
    parser.add_argument("--repeats", type=int, default=10, help="profiled steps (eager) or program runs (ratex)")
    parser.add_argument("--top", type=int, default=15, help="calls listed per mode")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one mode, in this process; JSON out
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        parser.error(f"unknown mode(s) {', '.join(bad)}; choose from {', '.join(MODES)}")
    if args.warmup < 2 or args.repeats < 1:
        parser.error(f"--warmup must be at least 2 and --repeats at least 1 (got {args.warmup}, {args.repeats})")
    if args.child:
        if args.child == "eager":
            result = profile_eager(args.model, args.warmup, args.repeats)
        else:
            result = profile_ratex(args.model, args.child, args.warmup, args.repeats)
        print(json.dumps(result))
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TVM_NUM_THREADS="1",
               RATEX_CACHE_DIR="", ENABLE_PARAM_ALIASING="true", RATEX_NATIVE_RUNNER="false")
    print(f"{args.model}: one training step, kernel by kernel, 1 thread, {args.repeats} repeats after {args.warmup} steps")
    for mode in modes:
        cmd = [sys.executable, os.path.abspath(__file__), args.model, "--child", mode,
               "--warmup", str(args.warmup), "--repeats", str(args.repeats)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            err = proc.stderr.strip().splitlines()
            print(f"\n{mode}: failed: {err[-1] if err else proc.returncode}")
            continue
        _report(mode, json.loads(proc.stdout.strip().splitlines()[-1]), args.top)


if __name__ == "__main__":
    main()
