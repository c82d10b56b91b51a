"""Where a training step's time goes on the tracing thread, phase by phase, against eager.

    python scripts/step_phases.py lenet-b1 [--modes eager,script,lazy,compile] [--steps 400]

Each mode trains one bench model (scripts/bench_models.py) in a fresh process, one torch/TVM
thread, with ENABLE_PARAM_ALIASING=true and no disk cache, as scripts/bench.py does. The
`compile` mode is torch.compile(train_step, backend="ratex") on CPU tensors: its step is one
call, shown under `fwd` (dynamo's frames, AOTAutograd's wrappers, eager zero_grad and optimizer
Python, ratex's programs and the calls around them). Printed per mode, after warm-up steps:
- the tracing thread's CPU time per step in each phase (µs): moving the batch to the device,
  zero_grad, forward, loss, backward, the optimizer step, mark_step;
- wall time per step (ms), which exceeds the CPU total where the thread waits;
- voluntary context switches per step of each thread that switched (Linux /proc; the tracing
  thread is `python`, the native runner `ratex-runner`). A tracing thread that switches is
  waiting for something (the GIL, a program); the runner switches once per look at its queue
  (it polls for a while after each run) and once per wait for the GIL, so a runner that waits
  for the GIL shows up here.

A last table splits the compile mode's wall time per step (median over steps) into the
programs' own runs (metric ExecuteTime) and the host time around them, against eager's step;
then, from a second pass of the same steps with timers around the graphs' calls (a few µs a
step of their own), the host time's shares: ratex's calls around its programs, AOTAutograd's
runtime wrappers with the autograd engine (`loss.backward()`), and the rest (dynamo's frames
and guards, eager zero_grad and optimizer Python).

bench.py says how fast; this says where the time goes when ratex is the slower one.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PHASES = ("to", "zero", "fwd", "loss", "bwd", "opt", "mark")
MODES = ("eager", "script", "lazy", "compile")


def _switches():
    """{thread id: (name, voluntary switches)} of this process's threads (empty off Linux)."""
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/status") as f:
                count = next(int(line.split(":")[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        except (OSError, StopIteration):
            continue
        out[tid] = (name, count)
    return out


def _models():
    """The models of scripts/bench_models.py."""
    from bench_models import MODELS

    return MODELS


def measure(model_name: str, mode: str, steps: int, warmup: int) -> dict:
    """Train `model_name` under `mode` in this process; return the per-step figures."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch

    from bench_models import POOL

    torch.set_num_threads(1)
    spec = _models()[model_name]
    torch.manual_seed(0)
    batches = spec.batches(1)
    model = spec.build()
    executed = None
    if mode in ("eager", "compile"):
        dev = torch.device("cpu")
        mark = wait = lambda: None  # noqa: E731
        if mode == "compile":
            import ratex  # noqa: F401  (registers the backend)
            from ratex.lazy_tensor_core.debug import metrics

            executed = lambda: (metrics.metric_data("ExecuteTime") or (0, 0.0))[1]  # noqa: E731
    else:
        import ratex
        import ratex.lazy_tensor_core.core.lazy_model as lm

        dev = lm.lazy_device()
        mark, wait = lm.mark_step, lm.wait_device_ops
        if mode == "script":
            model = ratex.jit.script(model)
    model.to(dev)
    model.train()
    opt = spec.optimizer(model.parameters())
    if mode == "compile":
        def train_step(x, y):
            opt.zero_grad()
            loss = spec.loss(model(x), y)
            loss.backward()
            opt.step()
            return loss

        compiled = torch.compile(train_step, backend="ratex")
        split, timing = _time_graph_calls()
    clock = time.thread_time
    totals = dict.fromkeys(PHASES, 0.0)
    walls, programs = [], []
    for i in range(warmup + steps):
        if i == warmup:
            wait()
            totals = dict.fromkeys(PHASES, 0.0)
            before, start = _switches(), time.perf_counter()
        x, y = batches[i % POOL]
        w0, e0 = time.perf_counter(), executed() if executed else 0.0
        t0 = clock()
        x, y = x.to(dev), y.to(dev)
        t1 = clock()
        if mode == "compile":
            compiled(x, y)
            t2, t3 = t1, clock()  # the whole call under fwd
            t4 = t5 = t6 = t3
        else:
            opt.zero_grad()
            t2 = clock()
            out = model(x)
            t3 = clock()
            loss = spec.loss(out, y)
            t4 = clock()
            loss.backward()
            t5 = clock()
            opt.step()
            t6 = clock()
        mark()
        t7 = clock()
        walls.append(time.perf_counter() - w0)
        programs.append(executed() - e0 if executed else 0.0)
        for name, a, b in zip(PHASES, (t0, t1, t2, t3, t4, t5, t6), (t1, t2, t3, t4, t5, t6, t7)):
            totals[name] += b - a
    wait()
    wall = time.perf_counter() - start
    after = _switches()
    host_split = None
    if mode == "compile":  # the second pass, with the graphs' calls timed
        e0 = executed()
        timing[0] = True
        start2 = time.perf_counter()
        for i in range(steps):
            compiled(*batches[i % POOL])
        total = time.perf_counter() - start2
        timing[0] = False
        inner = split["inner"]
        host_split = {"ratex": inner - (executed() - e0), "aot": split["outer"] + split["backward"] - inner,
                      "rest": total - split["outer"] - split["backward"]}
        host_split = {k: v / steps * 1e6 for k, v in host_split.items()}
    switches = {f"{after[t][0]}:{t}": (after[t][1] - before[t][1]) / steps
                for t in after if t in before and after[t][1] > before[t][1]}
    walls, programs = walls[warmup:], programs[warmup:]
    return {"us": {k: v / steps * 1e6 for k, v in totals.items()}, "wall_ms": wall / steps * 1e3,
            "switches": switches, "step_us": statistics.median(walls) * 1e6,
            "programs_us": statistics.median(programs) * 1e6,
            "host_us": statistics.median([w - p for w, p in zip(walls, programs)]) * 1e6,
            "host_split_us": host_split}


def _time_graph_calls():
    """Timers, off until `timing[0]` is set, around what a compiled step calls: ratex's graphs
    (CompiledGraph: its programs and the calls around them), the callables AOTAutograd makes of
    dynamo's graphs (wrapping ratex's), and torch.autograd.backward (the engine and AOTAutograd's
    backward, wrapping ratex's backward graph). Returns (seconds by name, timing)."""
    import collections  # noqa: PLC0415

    import torch  # noqa: PLC0415
    from ratex.dynamo import aot, program  # noqa: PLC0415

    split, timing = collections.defaultdict(float), [False]

    def timed(name, fn):
        def call(*args, **kwargs):
            if not timing[0]:
                return fn(*args, **kwargs)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                split[name] += time.perf_counter() - t
        # dynamo would otherwise compile the timer's frame where the step calls it (backward()
        # between two graphs) and guard it on `timing`: a recompile, then frames to check
        torch._dynamo.eval_frame.skip_code(call.__code__)
        return call

    graph_call = program.CompiledGraph.__call__
    program.CompiledGraph.__call__ = lambda self, args: timed("inner", graph_call)(self, args)
    capture = aot.capture
    aot.capture = lambda *a, **k: timed("outer", capture(*a, **k))
    torch.autograd.backward = timed("backward", torch.autograd.backward)
    return split, timing


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a model of scripts/bench_models.py, e.g. lenet-b1, or hf-gpt2-b4")
    parser.add_argument("--modes", default="eager,script,lazy", help=f"comma-separated: {','.join(MODES)}")
    parser.add_argument("--steps", type=int, default=400, help="measured steps per mode")
    parser.add_argument("--warmup", type=int, default=20, help="steps before measuring (compiles happen here)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one mode, in this process; JSON out
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    models = _models()
    if args.model not in models:
        parser.error(f"unknown model {args.model!r}; choose from {', '.join(models)}")
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        parser.error(f"unknown mode(s) {', '.join(bad)}; choose from {', '.join(MODES)}")
    if args.steps < 1 or args.warmup < 1:
        parser.error(f"--steps and --warmup must be at least 1 (got {args.steps}, {args.warmup})")
    if args.child:
        print(json.dumps(measure(args.model, args.child, args.steps, args.warmup)))
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TVM_NUM_THREADS="1",
               RATEX_CACHE_DIR="", ENABLE_PARAM_ALIASING="true")
    header = f"{'mode':>6}  " + "  ".join(f"{p:>6}" for p in PHASES) + f"  {'total':>6}  {'wall ms':>7}  switches/step"
    print(f"{args.model}: tracing-thread CPU µs per step by phase, {args.steps} steps after {args.warmup}")
    print(header)
    print("-" * len(header))
    steps = {}
    for mode in modes:
        cmd = [sys.executable, os.path.abspath(__file__), args.model, "--child", mode,
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(f"{mode:>6}  failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        us = r["us"]
        switches = ", ".join(f"{name.split(':')[0]} {n:.1f}" for name, n in sorted(r["switches"].items())) or "-"
        print(f"{mode:>6}  " + "  ".join(f"{us[p]:6.0f}" for p in PHASES)
              + f"  {sum(us.values()):6.0f}  {r['wall_ms']:7.3f}  {switches}")
        steps[mode] = r
    if "compile" in steps:
        r, eager = steps["compile"], steps.get("eager")
        share = f" = {r['host_us'] / eager['step_us']:.0%} of eager's step ({eager['step_us']:.0f} µs)" if eager else ""
        print(f"\ncompile: median step {r['step_us']:.0f} µs = programs {r['programs_us']:.0f} (ExecuteTime) "
              f"+ host {r['host_us']:.0f}{share}")
        h = r["host_split_us"]
        print(f"  its host time, timed apart (mean µs a step): ratex's calls around its programs {h['ratex']:.0f}, "
              f"AOTAutograd's wrappers and the autograd engine {h['aot']:.0f}, dynamo's frames and eager "
              f"Python (zero_grad, optimizer) {h['rest']:.0f}")


if __name__ == "__main__":
    main()
