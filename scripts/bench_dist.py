"""Data-parallel training step: ms per step and all-reduce ms per step at N ranks (scripts/bench.py --nproc N).

    .venv/bin/python scripts/bench.py --nproc 2                      # gpt2l-b8 and mlp-b128
    .venv/bin/python scripts/bench.py --nproc 2 --models lenet-b64 --steps 12

Each model of scripts/bench_models.py trains on ratex's lazy device in one
process, then in --nproc processes joined by torch.distributed (gloo, on this
machine's loopback), each rank on the model's whole batch (weak scaling, as DDP
is used: N ranks train on N batches per step). Gradients are averaged by
`lm.optimizer_step` (flat buckets of at most 25 MiB, one all-reduce each). Every
step waits for its programs, so a step's time is its tracing, its programs and
its collectives end to end.

Columns: median ms per step over the steps after --warmup (rank 0); of it, the
all-reduce ms (metric CollectiveTime: copying the gradients into buckets and out
excluded) and its share; MB all-reduced per step by each rank; programs run per
step. ENABLE_PARAM_ALIASING=true, one torch/TVM thread per rank.
"""
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(model_name: str, steps: int, out: str):
    """One rank (or the single process): train `steps` steps, write per-step measurements to OUT.rank."""
    import datetime

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    import ratex  # noqa: F401
    import ratex.lazy_tensor_core.core.lazy_model as lm
    from ratex.lazy_tensor_core.debug import metrics

    from bench_models import MODELS

    spec = MODELS[model_name]
    torch.manual_seed(0)
    dev = lm.lazy_device()
    model = spec.build().to(dev)
    opt = spec.optimizer(model.parameters())
    batches = spec.batches(1 + rank)  # each rank its own data

    def total(name):
        data = metrics.metric_data(name)
        return (data[0], data[1]) if data else (0, 0.0)

    rows = []
    for step in range(steps):
        x, y = batches[step % len(batches)]
        comm0, run0 = total("CollectiveTime"), total("ExecuteTime")
        bytes0 = metrics.counter_value("CollectiveBytes") or 0
        start = time.perf_counter()
        opt.zero_grad()
        loss = spec.loss(model(x.to(dev)), y.to(dev))
        loss.backward()
        lm.optimizer_step(opt)
        lm.mark_step()
        lm.wait_device_ops()
        end = time.perf_counter()
        comm1, run1 = total("CollectiveTime"), total("ExecuteTime")
        rows.append({"ms": (end - start) * 1e3, "comm_ms": (comm1[1] - comm0[1]) * 1e3,
                     "bytes": (metrics.counter_value("CollectiveBytes") or 0) - bytes0, "programs": run1[0] - run0[0]})
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"rows": rows, "loss": loss.item()}, f)
    if world > 1:
        dist.destroy_process_group()


def _launch(model: str, nproc: int, steps: int, timeout: float) -> dict:
    """Rank 0's measurements of `model` trained by `nproc` processes, or {'error': ...}."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(prefix="ratex-bench-dist-"), "result")
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), RATEX_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   TVM_NUM_THREADS="1", ENABLE_PARAM_ALIASING="true", RATEX_CACHE_DIR="")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", model, str(steps), out],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    errors = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return {"error": f"timed out after {timeout:g} s"}
        if p.returncode:
            errors.append(err.strip().splitlines()[-1] if err.strip() else f"exit {p.returncode}")
    if errors:
        return {"error": errors[0]}
    with open(f"{out}.0") as f:
        return json.load(f)


def run(models: list, nproc: int, steps: int, warmup: int, timeout: float):
    """Print the table of ms per step and all-reduce ms per step, one process against `nproc`."""
    print(f"{nproc} ranks over gloo (loopback) against 1 process; {steps} steps, median over steps "
          f"{warmup + 1}..{steps}; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    print()
    print("| model | ranks | ms/step | all-reduce ms/step | all-reduce share | MB all-reduced/step | programs/step |")
    print("|---|---|---|---|---|---|---|")
    for model in models:
        for n in (1, nproc):
            r = _launch(model, n, steps, timeout)
            if "error" in r:
                print(f"| {model} | {n} | {r['error']} | | | | |", flush=True)
                continue
            rows = r["rows"][warmup:]
            ms = statistics.median(x["ms"] for x in rows)
            comm = statistics.median(x["comm_ms"] for x in rows)
            mb = statistics.median(x["bytes"] for x in rows) / 2**20
            programs = statistics.median(x["programs"] for x in rows)
            print(f"| {model} | {n} | {ms:.2f} | {comm:.2f} | {comm / ms:.1%} | {mb:.2f} | {programs:g} |", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        sys.exit("run through scripts/bench.py --nproc N")
