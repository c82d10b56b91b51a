"""Training-step benchmark: ratex against eager PyTorch, torch.compile and torch._lazy.

    .venv/bin/python scripts/bench.py                       # every model x every system
    .venv/bin/python scripts/bench.py --models lenet-b1,mlp-b128 --steps 10
    .venv/bin/python scripts/bench.py --steps 45 --json bench.json
    python scripts/bench.py --device gpu                    # on CUDA: eager, compile, ratex with RATEX_DEVICE=GPU
    .venv/bin/python scripts/bench.py --nproc 2             # data parallel: ms/step and all-reduce ms/step (bench_dist.py)

Each (model, system) cell trains the model for --steps steps in a fresh
subprocess (zero_grad, forward, loss, backward, optimizer step; synthetic data
made in the subprocess and moved to the device every step, as a loader's
batches would be). Cells run model by model, round-robin over the systems, and
the round is repeated --repeats times (the system order rotates each round).

Systems:
  eager         PyTorch on the CPU (on CUDA with --device gpu)
  compile       torch.compile of the whole train-step function
  torch_lazy    torch._lazy with the TorchScript backend (never imports ratex; CPU only)
  ratex_lazy    ratex's lazy device
  ratex_script  ratex.jit.script(model) on ratex's lazy device
  ratex_amp     ratex_lazy with the forward and loss under ratex.amp.autocast(dtype=torch.bfloat16)
                (not in the default set: name it with --systems); its loss is checked against
                ratex_lazy's float32 loss: within 2%
  ratex_bf16    ratex_lazy with RATEX_USE_BF16=1: float32 tensors stored and computed as bfloat16
                on the device (not in the default set); its loss is checked as ratex_amp's
  ratex_compile torch.compile(train_step, backend="ratex"): dynamo and AOTAutograd capture
                forward, backward and optimizer step once; ratex compiles them with TVM and
                runs them on CPU tensors (CUDA tensors with --device gpu)

--device gpu runs eager, compile and ratex_compile on CUDA and the lazy ratex systems with
RATEX_DEVICE=GPU. Eager
CUDA steps run at most one step ahead of the GPU (a CUDA event per step), as ratex
runs at most one program ahead, and with cuDNN's TF32 off, so that eager computes
float32 convolutions as ratex does.

Table 1: median ms/step over the steps after the first --warmup ones (the last
step is also left out: it is the one whose ATen ops are counted), seconds of
the first step (compile included), ratio of the median to eager's, the final
loss, and for ratex cells whether it equals eager's final loss within rtol 1e-4 and
how many programs were compiled (ratex_compile: one per graph that dynamo and
AOTAutograd hand over). Models with dropout (mnist-b64) draw different
random masks than eager does, so that check is marked 'n/a (dropout)' (dropout
is not disabled: the benchmark measures the model as it trains); ratex_script
and ratex_compile draw ratex_lazy's masks (the same seeds from torch's generator,
in the same order), so their loss is checked against ratex_lazy's. A
ratex_script cell whose model jit.script could not script (it then runs on the
plain lazy device) is footnoted with ratex's warning.

A step's time runs from its start to the next step's start. Lazy steps (ratex,
torch._lazy) end with mark_step, which launches the step's program and returns:
as in a training loop that reads the loss only now and then, the next step's
Python runs while the program executes (ratex lets tracing run at most one
program ahead). The first step and the last wait for their programs. With
--serial every step waits for its program, so a step's time is its tracing,
mark_step and execution end to end.

Table 2 (ratex's lazy cells): tracing cost per ATen op on a cache hit, two ways, over
the top-level ATen calls that reach ratex's handler (`ratex.core.tracing.dispatch`)
in one step (the nested calls of ratex's own decompositions are shown after a
'+'): 'dispatch us/op' is the CPU time inside that handler per call, what ratex's
tracer costs; 'trace us/op' is all the Python thread's CPU time in a step before
mark_step per call, which also holds what eager PyTorch pays too (the autograd
engine, the optimizer's Python, torch's dispatcher and its call into a Python
tensor subclass). Then shares of step time: tracing and mark_step (graph
cut, cache lookup, launch, and waiting for the program before the previous one)
on the Python thread, and execution (metric 'ExecuteTime') on ratex's executor
thread. Pipelined, execution overlaps the other two, so the shares may add up to
more than 100%; the larger of (trace + mark_step less its wait) and execute is
what bounds the step. Waiting at a sync point inside the step (.item()) is not
trace time, but an op with no lowering, run eagerly on the Python thread, is;
programs/step and eager-fallback ops/step show such steps.

Ratex cells run with ENABLE_PARAM_ALIASING=true, as the tutorial trains: a step
writes parameters and optimizer state into their own buffers, as eager's in-place
optimizer does (--no-param-aliasing: fresh buffers every step, so the update
kernels write new tensors as large as the parameters and optimizer state).

Threads: every cell runs with --threads (default 1) OpenMP/MKL/TVM threads and
torch.set_num_threads. On a shared machine, more threads than free cores make
OpenMP kernels (eager's, inductor's, TVM's) spin and run far slower.

Ratex subprocesses run with RATEX_CACHE_DIR="" (no persistent compile cache) and
compile cells with a fresh TORCHINDUCTOR_CACHE_DIR, so first-step time is a cold
compile; --warm-cache keeps the environment's caches.
"""
import argparse
import importlib.metadata
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

SYSTEMS = ["eager", "compile", "torch_lazy", "ratex_lazy", "ratex_script", "ratex_compile", "ratex_amp", "ratex_bf16"]
BF16_SYSTEMS = ("ratex_amp", "ratex_bf16")  # train in bfloat16; their loss is checked against ratex_lazy's
DEFAULT_SYSTEMS = [s for s in SYSTEMS if s not in BF16_SYSTEMS]
AMP_TOLERANCE = 0.02  # a bfloat16 run's final loss, relative to float32's
MODELS = ["lenet-b1", "lenet-b64", "mnist-b64", "mlp-b128", "gpt2l-b8"]
REAL_MODELS = ["hf-gpt2-b4", "hf-bert-b4", "lstm-b8"]  # --models real: models nobody here tuned for
DIST_MODELS = ["gpt2l-b8", "mlp-b128"]  # --nproc: the models whose gradients are worth all-reducing
LAZY_RATEX = ("ratex_lazy", "ratex_script", "ratex_amp", "ratex_bf16")  # the lazy device: traced per op, a program per mark_step
RATEX = (*LAZY_RATEX, "ratex_compile")
MARK = "BENCH_RESULT "




def _same_loss(a: float, b: float) -> bool:
    """Final losses equal as the tests compare them (rtol 1e-4): rounding both to 4 decimals
    calls 6.057347 and 6.057351 different."""
    return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)


# ---- one cell, in its own process ------------------------------------------------

def _error_line(exc):
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


class _Messages:
    """The first lines of the warnings caught so far, read lazily."""

    def __init__(self, log):
        self.log = log

    def __iter__(self):
        return (str(w.message).strip().splitlines()[0] for w in self.log if str(w.message).strip())


def run_cell(model_name, system, steps, warmup, caught=(), serial=False, gpu=False):
    """Train one model under one system (ratex: on the device RATEX_DEVICE names; the others
    on CUDA if `gpu`); return a dict of measurements."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch

    from bench_models import MODELS as SPECS, POOL

    threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    spec = SPECS[model_name]
    result = {"model": model_name, "system": system, "steps": steps, "warmup": warmup,
              "torch_threads": torch.get_num_threads()}
    counter = None
    metrics = None

    if system == "torch_lazy":
        import torch._lazy
        import torch._lazy.ts_backend

        torch._lazy.ts_backend.init()
        dev = torch.device("lazy")

        mark, wait = torch._lazy.mark_step, torch._lazy.wait_device_ops

    elif system in LAZY_RATEX:
        import ratex
        import ratex.core.tensor as rtensor
        import ratex.core.tracing.registry as rops
        import ratex.lazy_tensor_core.core.lazy_model as lm
        from ratex.lazy_tensor_core.debug import metrics

        dev = lm.lazy_device()

        mark, wait = lm.mark_step, lm.wait_device_ops
        counter = _DispatchCounter(rops, rtensor)
    elif system == "ratex_compile":
        import ratex  # noqa: F401  (registers the "ratex" backend)
        from ratex.lazy_tensor_core.debug import metrics

        dev = torch.device("cuda" if gpu else "cpu")
        if gpu:
            torch.backends.cudnn.allow_tf32 = False  # float32 convolutions, as ratex computes them
            mark, wait = _one_step_ahead(torch), torch.cuda.synchronize
        else:
            mark = wait = lambda: None
    elif gpu:
        dev = torch.device("cuda")
        torch.backends.cudnn.allow_tf32 = False  # float32 convolutions, as ratex computes them
        mark, wait = _one_step_ahead(torch), torch.cuda.synchronize
    else:
        dev = torch.device("cpu")
        mark = wait = lambda: None

    import faulthandler

    # after the imports: TVM installs a SIGSEGV handler that prints only C frames
    faulthandler.enable(all_threads=True)

    torch.manual_seed(0)
    batches = spec.batches(1)
    model = spec.build()
    if system == "ratex_script":
        model = ratex.jit.script(model)
    model.to(dev)
    model.train()
    opt = spec.optimizer(model.parameters())

    def train_step(x, y):
        opt.zero_grad()
        if system == "ratex_amp":
            with ratex.amp.autocast(dtype=torch.bfloat16):
                loss = spec.loss(model(x), y)
        else:
            loss = spec.loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    step_fn = train_step
    if system == "compile":
        step_fn = torch.compile(train_step)
    elif system == "ratex_compile":
        step_fn = torch.compile(train_step, backend="ratex")

    def exec_total():
        if metrics is None:
            return 0.0
        data = metrics.metric_data("ExecuteTime")
        return data[1] if data else 0.0

    def counts():
        if metrics is None:
            return {}
        return {k: metrics.counter_value(k) or 0 for k in metrics.counter_names()}

    # starts: when each step began (a step's time runs to the next one's start); traces: CPU time
    # of this (Python) thread up to mark_step -- not wall time, which would include waiting at a
    # sync point inside the step and the previous program running beside it; marks: inside
    # mark_step; execs: all execution finished during the step.
    # Steps are pipelined as in training: mark_step launches the program and returns, and the
    # next step's Python overlaps it (ratex keeps at most one program queued behind the running
    # one). The first and last steps wait for their programs; so does every step with --serial.
    starts, traces, marks, execs = [], [], [], []
    loss = None
    for i in range(steps):
        x, y = batches[i % POOL]
        counting = counter is not None and i == steps - 1
        if counting:
            counter.install()
            before = counts()
        e0 = exec_total()
        t0, c0 = time.perf_counter(), time.thread_time()
        starts.append(t0)
        x, y = x.to(dev), y.to(dev)
        loss = step_fn(x, y)
        t1, c1 = time.perf_counter(), time.thread_time()
        mark()
        t2 = time.perf_counter()
        if serial or i == 0 or i == steps - 1:
            wait()
        if counting:
            counter.uninstall()
            after = counts()
            delta = {k: v - before.get(k, 0) for k, v in after.items()}
            result["programs_per_step"] = delta.get("UncachedCompile", 0) + delta.get("CachedCompile", 0)
            result["fallbacks_per_step"] = sum(v for k, v in delta.items() if k.startswith("aten::"))
        traces.append(c1 - c0)
        marks.append(t2 - t1)
        execs.append(exec_total() - e0)
        if i == 0 and metrics is not None:
            result["first_step_compiles"] = metrics.counter_value("UncachedCompile") or 0
    times = [b - a for a, b in zip(starts, starts[1:])] + [time.perf_counter() - starts[-1]]
    result["final_loss"] = float(loss.detach().to("cpu").item())
    if system == "ratex_script" and not (metrics.counter_value("ratex::script_fwd.default") or 0):
        result["script_fallback"] = next((w for w in caught if "jit.script" in w), "no script_fwd node recorded")
    result["times"] = times
    result["first_step_s"] = times[0]
    timed = slice(warmup, steps - 1)
    result["median_ms"] = statistics.median(times[timed]) * 1e3
    if metrics is not None:
        result["compiles"] = metrics.counter_value("UncachedCompile") or 0
        fallbacks = {k: v for k, v in ((k, metrics.counter_value(k)) for k in metrics.counter_names())
                     if k.startswith("aten::")}
        result["fallback_ops"] = fallbacks
    if counter is not None:
        result["ops_total"] = counter.total
        result["ops_top"] = counter.top
        trace = statistics.median(traces[timed])
        result["trace_ms"] = trace * 1e3
        result["us_per_op"] = trace * 1e6 / counter.top if counter.top else None
        result["dispatch_us_per_op"] = counter.inside * 1e6 / counter.top if counter.top else None
        step_sum = sum(times[timed])
        result["share"] = {k: sum(v[timed]) / step_sum for k, v in (("trace", traces), ("mark", marks), ("execute", execs))}
        result["counters"] = {k: metrics.counter_value(k) for k in metrics.counter_names()}
        tuning = metrics.metric_data("TuneTime")  # RATEX_TUNE: seconds spent tuning kernels
        result["tune_s"] = tuning[1] if tuning else 0.0
    return result


def _one_step_ahead(torch):
    """mark_step for eager CUDA: let Python run at most one step ahead of the GPU."""
    last = [None]

    def mark():
        event = torch.cuda.Event()
        event.record()
        if last[0] is not None:
            last[0].synchronize()
        last[0] = event

    return mark


class _DispatchCounter:
    """Counts calls to ratex's tracer while installed: LazyTensor's entry point (tensor.install)
    and the router's nested calls (the tracing modules call `registry.dispatch`)."""

    def __init__(self, ops_module, tensor_module):
        self.ops, self.tensor = ops_module, tensor_module
        self.orig = ops_module.dispatch
        self.total = self.top = self.depth = 0
        self.inside = 0.0  # CPU seconds inside top-level calls

    def install(self):
        orig = self.orig
        clock = time.thread_time

        def counting(func, args, kwargs):
            self.total += 1
            top = self.depth == 0
            if top:
                self.top += 1
                t0 = clock()
            self.depth += 1
            try:
                return orig(func, args, kwargs)
            finally:
                self.depth -= 1
                if top:
                    self.inside += clock() - t0

        self.ops.dispatch = counting
        self.tensor.install(dispatch=counting)

    def uninstall(self):
        self.ops.dispatch = self.orig
        self.tensor.install(dispatch=self.orig)


def cell_main(args):
    import warnings

    try:
        with warnings.catch_warnings(record=True) as log:
            warnings.simplefilter("default")
            result = run_cell(args.cell[0], args.cell[1], args.steps, args.warmup, caught=_Messages(log),
                              serial=args.serial, gpu=args.device == "gpu")
    except Exception as exc:  # report, don't crash: the parent prints 'fails'
        import traceback

        traceback.print_exc()
        result = {"model": args.cell[0], "system": args.cell[1], "error": _error_line(exc)}
    sys.stdout.flush()
    print(MARK + json.dumps(result), flush=True)


# ---- the driver ------------------------------------------------------------------
def _version(dist):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _gpu_name():
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "none visible to torch"


def spawn(model, system, args):
    env = dict(os.environ)
    if args.threads > 0:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TVM_NUM_THREADS"):
            env[var] = str(args.threads)
    tmp = None
    if system in RATEX:  # the seed tutorial's setting: parameters and optimizer state update in place
        env["ENABLE_PARAM_ALIASING"] = "false" if args.no_param_aliasing else "true"
        env["RATEX_DEVICE"] = args.device.upper()
        for var in ("RATEX_USE_BF16", "LTC_USE_BF16"):  # bfloat16 storage is the ratex_bf16 cell's alone
            env.pop(var, None)
        if system == "ratex_bf16":
            env["RATEX_USE_BF16"] = "1"
    if not args.warm_cache:
        if system in RATEX:
            env["RATEX_CACHE_DIR"] = ""
            env.pop("RATEX_TUNE", None)  # tuning needs the cache dir (scripts/tune.py measures it)
        elif system == "compile":  # inductor keeps compiled kernels in /tmp: give it an empty one
            tmp = tempfile.TemporaryDirectory(prefix="bench-inductor-")
            env["TORCHINDUCTOR_CACHE_DIR"] = tmp.name
    try:
        return run_process(model, system, env, steps=args.steps, warmup=args.warmup, timeout=args.timeout,
                           verbose=args.verbose, serial=args.serial, device=args.device)
    finally:
        if tmp is not None:
            tmp.cleanup()


def run_process(model, system, env, *, steps, warmup, timeout, verbose=False, serial=False, device="cpu"):
    """Run one cell in a fresh process with environment `env`; return its result dict (with
    "error" if it failed). scripts/tune.py times its configurations with it too."""
    cmd = [sys.executable, os.path.abspath(__file__), "--cell", model, system,
           "--steps", str(steps), "--warmup", str(warmup), "--device", device] + (["--serial"] if serial else [])
    start = time.time()
    # own process group, so a timeout also ends the cell's helpers (e.g. inductor's compile workers)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"model": model, "system": system, "error": f"timed out after {timeout:g} s"}
    wall = time.time() - start
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARK):
            result = json.loads(line[len(MARK):])
            result["wall_s"] = wall
            if "error" in result and verbose:
                sys.stderr.write(stderr[-4000:])
            return result
    if verbose:
        sys.stderr.write(stderr[-4000:])
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    if proc.returncode < 0:
        try:
            why = f"killed by {signal.Signals(-proc.returncode).name}"
        except ValueError:
            why = f"killed by signal {-proc.returncode}"
        # faulthandler's report: the crashing thread's innermost Python frame
        frames = lines[lines.index(next(ln for ln in lines if ln.startswith("Current thread"))) + 1:] \
            if any(ln.startswith("Current thread") for ln in lines) else []
        where = frames[0] if frames and frames[0].startswith("File ") else ""
        return {"model": model, "system": system, "error": why + (f", in {where}" if where else "")}
    last = lines[-1] if lines else ""
    return {"model": model, "system": system,
            "error": f"process exited with status {proc.returncode}" + (f": {last}" if last else "")}


def combine(runs):
    """Merge the repeats of one cell: medians of their medians."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return dict(runs[0])
    out = dict(ok[-1])
    out["median_ms"] = statistics.median(r["median_ms"] for r in ok)
    out["first_step_s"] = statistics.median(r["first_step_s"] for r in ok)
    if "trace_ms" in out:
        out["trace_ms"] = statistics.median(r["trace_ms"] for r in ok)
        if out.get("ops_top"):
            out["us_per_op"] = out["trace_ms"] * 1e3 / out["ops_top"]
            out["dispatch_us_per_op"] = statistics.median(r["dispatch_us_per_op"] for r in ok)
        for k in ("trace", "mark", "execute"):
            out["share"][k] = statistics.median(r["share"][k] for r in ok)
    out["repeats_ok"] = len(ok)
    out["runs"] = runs
    return out


def table(header, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda row: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
    lines = [fmt(header), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in rows]
    return "\n".join(lines)


def report(models, systems, cells, args):
    from bench_models import MODELS as SPECS

    footnotes = []

    def fails(r):
        footnotes.append(f"[{len(footnotes) + 1}] {r['model']} / {r['system']}: {r['error']}")
        return f"fails [{len(footnotes)}]"

    rows = []
    for m in models:
        eager = cells.get((m, "eager"))
        eager_ok = eager is not None and "error" not in eager
        for s in systems:
            r = cells[(m, s)]
            if "error" in r:
                rows.append([m, s, fails(r), "", "", "", "", ""])
                continue
            ratio = f"{r['median_ms'] / eager['median_ms']:.2f}x" if eager_ok else "-"
            name = s
            if r.get("script_fallback"):
                footnotes.append(f"[{len(footnotes) + 1}] {m} / {s}: ran on the plain lazy device, "
                                 f"not scripted: {r['script_fallback']}")
                name = f"{s} [{len(footnotes)}]"
            if s == "ratex_compile" and r.get("fallback_ops"):
                ops = ", ".join(f"{k} x{v}" for k, v in r["fallback_ops"].items())
                footnotes.append(f"[{len(footnotes) + 1}] {m} / {s}: ops run in eager PyTorch: {ops}")
                name = f"{s} [{len(footnotes)}]"
            loss = check = compiles = ""
            if s in RATEX:
                loss = f"{r['final_loss']:.4f}"
                compiles = str(r.get("compiles", ""))
                lazy = cells.get((m, "ratex_lazy"))
                if s in BF16_SYSTEMS:
                    if lazy is None or "error" in lazy:
                        check = "- (no ratex_lazy)"
                    else:
                        off = abs(r["final_loss"] - lazy["final_loss"]) / abs(lazy["final_loss"])
                        check = (f"{'yes' if off <= AMP_TOLERANCE else 'NO'} ({off * 100:.2f}% off "
                                 "ratex_lazy's float32)")
                elif SPECS[m].dropout and s in ("ratex_script", "ratex_compile") and lazy is not None \
                        and "error" not in lazy:
                    # Same seeds, same masks: the scripted and the compiled model must train as the lazy one.
                    same = _same_loss(r["final_loss"], lazy["final_loss"])
                    check = "yes (= ratex_lazy)" if same else f"NO (ratex_lazy {lazy['final_loss']:.4f})"
                elif SPECS[m].dropout:
                    check = "n/a (dropout)"
                elif not eager_ok:
                    check = "- (no eager)"
                else:
                    same = _same_loss(r["final_loss"], eager["final_loss"])
                    check = "yes" if same else f"NO (eager {eager['final_loss']:.4f})"
            else:
                loss = f"{r['final_loss']:.4f}"
            rows.append([m, name, f"{r['median_ms']:.2f}", f"{r['first_step_s']:.2f}", ratio, loss, check, compiles])
    print(table(["model", "system", "ms/step", "first step s", "vs eager", "final loss",
                 "= eager (rtol 1e-4)", "compiles"], rows))

    rows2 = []
    for m in models:
        for s in systems:
            if s not in LAZY_RATEX:
                continue
            r = cells[(m, s)]
            if "error" in r:
                rows2.append([m, s, "fails", "", "", "", "", "", "", "", ""])
                continue
            sh = r["share"]
            upo = f"{r['us_per_op']:.1f}" if r.get("us_per_op") else "-"
            dpo = f"{r['dispatch_us_per_op']:.1f}" if r.get("dispatch_us_per_op") else "-"
            rows2.append([m, s, f"{r['ops_top']} (+{r['ops_total'] - r['ops_top']})",
                          str(r.get("programs_per_step", "")),
                          str(r.get("fallbacks_per_step", "")), f"{r['trace_ms']:.2f}", dpo, upo,
                          f"{sh['trace'] * 100:.0f}%", f"{sh['mark'] * 100:.0f}%", f"{sh['execute'] * 100:.0f}%"])
    if rows2:
        print()
        print("ratex cells, cache-hit steps: tracing cost and where the step time goes "
              "(ATen ops: top-level calls that reach ratex, + the nested calls of its decompositions; "
              "trace ms: median CPU time of the Python thread before mark_step; "
              "dispatch us/op: CPU time inside ratex's handler per top-level op; "
              "trace us/op: trace ms per top-level op, autograd engine, optimizer Python and torch's "
              "dispatcher included; "
              "shares of step time: trace and mark_step on the Python thread, execute on the executor thread, "
              "which overlaps them" + (")" if args.serial else " unless --serial)"))
        print(table(["model", "system", "ATen ops/step", "programs/step", "eager-fallback ops/step",
                     "trace ms", "dispatch us/op", "trace us/op",
                     "trace", "mark_step", "execute"], rows2))
    if footnotes:
        print()
        print("\n".join(footnotes))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--models", help="comma-separated: " + ",".join(MODELS + REAL_MODELS) + ", or real for the last "
                   + str(len(REAL_MODELS)) + " (default: the first " + str(len(MODELS)) + "; with --nproc "
                   + ",".join(DIST_MODELS) + ")")
    p.add_argument("--systems", help="comma-separated: " + ",".join(SYSTEMS) + " (default: all but " + " and ".join(BF16_SYSTEMS) + "; "
                   "with --device gpu also not torch_lazy)")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                   help="gpu: eager and compile on CUDA, ratex with RATEX_DEVICE=GPU")
    p.add_argument("--steps", type=int, default=20, help="train steps per cell (45 when checking losses)")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    p.add_argument("--repeats", type=int, default=1, help="rounds over the systems per model")
    p.add_argument("--timeout", type=float, default=300, help="seconds per cell")
    p.add_argument("--threads", type=int, default=1,
                   help="OMP/MKL/TVM threads and torch.set_num_threads in every cell (0: library defaults); "
                        "on a shared machine more threads than free cores make OpenMP kernels crawl")
    p.add_argument("--json", metavar="PATH", help="write every cell's measurements here")
    p.add_argument("--warm-cache", action="store_true", help="keep RATEX_CACHE_DIR (default: disable it)")
    p.add_argument("--no-param-aliasing", action="store_true",
                   help="run ratex with ENABLE_PARAM_ALIASING=false (default: true, as the tutorial trains)")
    p.add_argument("--verbose", action="store_true", help="print failing cells' stderr")
    p.add_argument("--serial", action="store_true",
                   help="wait for each step's program before the next step starts (no overlap of tracing and execution)")
    p.add_argument("--nproc", type=int, default=1,
                   help="N > 1: ratex data-parallel over N torch.distributed ranks against one process "
                        "(ms/step and all-reduce ms/step; scripts/bench_dist.py)")
    p.add_argument("--cell", nargs=2, metavar=("MODEL", "SYSTEM"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steps < args.warmup + 2:
        p.error(f"--steps must be at least --warmup + 2 = {args.warmup + 2}")
    if args.cell:
        return cell_main(args)
    if args.nproc > 1:
        import bench_dist

        models = [m for m in (args.models or ",".join(DIST_MODELS)).split(",") if m]
        if [m for m in models if m not in MODELS]:
            p.error(f"unknown model: {', '.join(m for m in models if m not in MODELS)}")
        return bench_dist.run(models, args.nproc, args.steps, args.warmup, args.timeout)

    models = [n for m in (args.models or ",".join(MODELS)).split(",") if m for n in (REAL_MODELS if m == "real" else [m])]
    gpu_systems = [s for s in DEFAULT_SYSTEMS if s != "torch_lazy"]
    systems = [s for s in (args.systems or ",".join(gpu_systems if args.device == "gpu" else DEFAULT_SYSTEMS)).split(",")
               if s]
    bad = [m for m in models if m not in MODELS + REAL_MODELS] + [s for s in systems if s not in SYSTEMS]
    if bad:
        p.error(f"unknown model/system: {', '.join(bad)}")
    if args.device == "gpu" and "torch_lazy" in systems:
        p.error("torch_lazy is benchmarked on the CPU only; --device gpu takes " + ",".join(gpu_systems))

    print(f"torch {_version('torch')}, apache-tvm {_version('apache-tvm')}, python {platform.python_version()}, "
          f"{os.cpu_count()} cores ({platform.machine()}), load average {os.getloadavg()[0]:.2f}"
          + (f", GPU: {_gpu_name()}" if args.device == "gpu" else ""))
    print(f"{args.steps} steps per cell, median over steps {args.warmup + 1}..{args.steps - 1}, "
          f"{args.repeats} repeat(s), timeout {args.timeout:g} s, "
          f"{args.threads if args.threads > 0 else 'default'} thread(s) per cell, "
          + ("serial steps, " if args.serial else "lazy steps pipelined (next step traced while one runs), ")
          + f"ratex with ENABLE_PARAM_ALIASING={'false' if args.no_param_aliasing else 'true'}, "
          + "compile caches "
          + ("kept" if args.warm_cache else "disabled (RATEX_CACHE_DIR=\"\", fresh inductor cache dir: cold compile)"))
    print(flush=True)

    runs = {(m, s): [] for m in models for s in systems}
    for m in models:
        for rep in range(args.repeats):
            k = rep % len(systems)
            for s in systems[k:] + systems[:k]:
                r = spawn(m, s, args)
                runs[(m, s)].append(r)
                status = r["error"] if "error" in r else f"{r['median_ms']:.2f} ms/step"
                print(f"  {m} / {s} (round {rep + 1}): {status}", file=sys.stderr, flush=True)
    cells = {k: combine(v) for k, v in runs.items()}
    report(models, systems, cells, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": _version("torch"), "tvm": _version("apache-tvm"), "cores": os.cpu_count(),
                       "device": args.device,
                       "args": vars(args), "cells": [cells[k] for k in runs]}, f, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
