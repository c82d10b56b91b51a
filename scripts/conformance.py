#!/usr/bin/env python
"""OpInfo conformance of the lazy device against CPU PyTorch.

For every entry of PyTorch's OpInfo database (`op_db`) that supports float32 on
CPU, run its samples on CPU and on the lazy device and compare:

  forward   every sample's outputs (torch.testing.assert_close, rtol 1e-4,
            atol 1e-5, equal_nan)
  backward  (entries with op.supports_autograd) the gradients of the sum of all
            differentiable float outputs w.r.t. every float input that
            requires grad

Each direction of an entry gets one status:

  pass      every sample matched and nothing ran eagerly on CPU
  fallback  every sample matched, but some `aten::<op>` counter moved (an op
            ran on CPU PyTorch instead of being lowered to TVM)
  fail      a mismatch, an exception, a crash or a timeout
  skip      no sample could be checked (every sample failed on CPU itself, or
            produced nothing differentiable); not counted in the figures

Samples that raise on CPU are skipped. Samples whose CPU result is not
reproducible (random ops: two CPU runs differ, or a random ATen op ran, even
one OpInfo reseeds) and ops that return uninitialized memory (`empty*`) are
compared by structure, shape and dtype only.

Each entry runs in a worker subprocess (a pool of --workers, recycled after
--max-tasks tasks), so a crash, a hang (--timeout) or a memory blow-up
(--max-rss-gb) costs that entry only: it counts as `fail`.

    python scripts/conformance.py                    # all entries, print the figures
    python scripts/conformance.py --write            # ... and update tests/conformance_expectations.json
    python scripts/conformance.py --ops add,cumsum --verbose
    python scripts/conformance.py --details out.json # per-entry messages and fallback counters

The functions `entry_key`, `entries` and `check_entry` are also used in-process
by tests/test_conformance.py.
"""
import argparse
import collections
import copy
import json
import os
import re
import sys
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPECTATIONS = os.path.join(ROOT, "tests", "conformance_expectations.json")
RTOL, ATOL = 1e-4, 1e-5
DEFAULT_MAX_SAMPLES = 8
PHASES = ("forward", "backward")

# Ops whose outputs are uninitialized memory: only metadata can be compared.
UNINITIALIZED = re.compile(r"(^|\.|_)empty")


# --------------------------------------------------------------------------- #
# checking one entry (runs in a worker, or in-process from the tests)
# --------------------------------------------------------------------------- #

def entry_key(op):
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def entries(names=None):
    """{key: OpInfo} for the float32-capable op_db entries (all, or those in `names`)."""
    import torch
    from torch.testing._internal.common_methods_invocations import op_db

    out = {}
    for op in op_db:
        key = entry_key(op)
        if key in out:
            continue
        if names is not None and key not in names and op.name not in names:
            continue
        try:
            if torch.float32 not in op.supported_dtypes("cpu"):
                continue
        except Exception:
            continue
        out[key] = op
    return out


def _short(exc, limit=300):
    msg = str(exc).strip().splitlines()
    first = msg[0] if msg else ""
    return f"{type(exc).__name__}: {first}"[:limit]


def _mismatch_message(exc, limit=300):
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    # assert_close: "Tensor-likes are not close!", "Mismatched elements: ...", "Greatest absolute ..."
    return ("mismatch: " + " | ".join(lines[:3]))[:limit]


class _CpuFailed(Exception):
    pass


class _Skip(Exception):
    pass


def _tensors(tree):
    import torch
    from torch.utils._pytree import tree_leaves

    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _copy_parts(parts):
    """A copy of (input, args, kwargs) with the same layouts and requires_grad, sharing nothing."""
    import torch
    from torch.utils._pytree import tree_map

    try:
        return copy.deepcopy(parts)
    except Exception:
        pass

    def one(x):
        if not isinstance(x, torch.Tensor):
            return copy.copy(x)
        y = x.detach().clone()
        return y.requires_grad_(x.requires_grad) if (y.is_floating_point() or y.is_complex()) else y

    return tree_map(one, parts)


def _own_storage(parts):
    """The inputs as `.to(device)` delivers them: a view into a larger storage gets its own.

    The device copy of a view holds only the view's elements (as on CUDA), so ops that
    address storage directly (as_strided with a storage_offset) must see the same on CPU.
    """
    import torch
    from torch.utils._pytree import tree_map

    def one(x):
        if not isinstance(x, torch.Tensor) or x.layout != torch.strided:
            return x
        if x.storage_offset() == 0 and x.is_contiguous() and \
                x.untyped_storage().nbytes() == x.numel() * x.element_size():
            return x
        y = x.detach().clone(memory_format=torch.contiguous_format)
        return y.requires_grad_(True) if x.requires_grad else y

    return tree_map(one, parts)


def _to_lazy(parts, device):
    import torch
    from torch.utils._pytree import tree_map

    def one(x):
        if not isinstance(x, torch.Tensor):
            return x
        y = x.detach().to(device)
        return y.requires_grad_(True) if x.requires_grad else y

    return tree_map(one, parts)


def _to_cpu(tree):
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, tree)


def _same_metadata(got, want):
    import torch
    from torch.utils._pytree import tree_flatten

    gl, gs = tree_flatten(got)
    wl, ws = tree_flatten(want)
    if gs != ws:
        raise AssertionError(f"output structure differs: {gs} vs {ws}")
    for g, w in zip(gl, wl):
        if isinstance(w, torch.Tensor):
            if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
                raise AssertionError(
                    f"output metadata differs: {getattr(g, 'shape', type(g))}/{getattr(g, 'dtype', '')}"
                    f" vs {tuple(w.shape)}/{w.dtype}")


def _close(a, b):
    import torch

    try:
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, equal_nan=True)
        return True
    except Exception:
        return False


def _forward_fn(op):
    def run(parts):
        inp, args, kwargs = parts
        return op(inp, *args, **kwargs)
    return run


def _backward_fn(op, sample):
    """parts -> (grads, forward outputs) of the sum of all differentiable float outputs."""
    import torch

    process = sample.output_process_fn_grad or (lambda x: x)

    def run(parts):
        inp, args, kwargs = parts
        leaves = [t for t in _tensors(parts) if t.requires_grad and t.is_floating_point()]
        if not leaves:
            raise _Skip("no float input requires grad")
        out = process(op.gradcheck_wrapper(op.get_op(), inp, *args, **kwargs))
        outs = [t for t in _tensors(out) if t.is_floating_point() and t.requires_grad]
        if not outs:
            raise _Skip("no differentiable float output")
        loss = outs[0].sum()
        for t in outs[1:]:
            loss = loss + t.sum()
        grads = torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)
        return list(grads)
    return run


def _SeededOpsSeen():
    """A dispatch mode noting whether any random (`nondeterministic_seeded`) ATen op ran."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        any = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if torch.Tag.nondeterministic_seeded in func.tags:
                self.any = True
            return func(*args, **(kwargs or {}))

    return Mode()


def _check_sample(op, sample, phase, device, metadata_only):
    """Return ("pass"|"fallback"|"skip", info) or raise for a failure on the lazy side."""
    import ratex.lazy_tensor_core.core.lazy_model as lm
    from ratex.lazy_tensor_core.debug import metrics

    parts = _own_storage((sample.input, sample.args, sample.kwargs))
    lazy_parts = _to_lazy(_copy_parts(parts), device)   # before any CPU run can mutate `parts`
    fn = _forward_fn(op) if phase == "forward" else _backward_fn(op, sample)

    try:
        with _SeededOpsSeen() as seen:
            want = fn(_copy_parts(parts))
        again = fn(_copy_parts(parts))
    except _Skip:
        raise
    except Exception as e:
        raise _CpuFailed(_short(e))
    # A random op reseeded by OpInfo's wrapper repeats on CPU, but the lazy device
    # draws from its own stream (as CUDA does): compare such samples by structure.
    random = metadata_only or seen.any or not _close(again, want)

    metrics.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fn(lazy_parts)
        lm.mark_step()
        got = _to_cpu(got)
    fallbacks = sorted(c for c in metrics.counter_names() if c.startswith("aten::"))
    notes = sorted({str(w.message).splitlines()[0][:300] for w in caught if "ratex" in str(w.message)})

    if random:
        _same_metadata(got, want)
    else:
        try:
            import torch
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, equal_nan=True)
        except AssertionError as e:
            raise AssertionError(_mismatch_message(e)) from None
    return ("fallback" if fallbacks else "pass"), {"fallbacks": fallbacks, "notes": notes,
                                                   "metadata_only": random}


def _flush():
    """Drop whatever a failed sample left pending on the lazy device."""
    import gc

    import ratex.lazy_tensor_core.core.lazy_model as lm
    gc.collect()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lm.mark_step()
    except Exception:
        pass


def check_entry(op, phase, max_samples=DEFAULT_MAX_SAMPLES, device=None, seed=0):
    """Check one OpInfo entry in one direction. Return a dict with "status" and details."""
    import random as _random

    import numpy as np
    import torch

    device = device or torch.device("lazy", 0)
    metadata_only = bool(UNINITIALIZED.search(op.name))
    torch.manual_seed(seed)
    _random.seed(seed)
    np.random.seed(seed)
    result = {"status": "skip", "samples": 0, "cpu_failed": 0, "fallbacks": [], "notes": [],
              "metadata_only": False}
    try:
        samples = op.sample_inputs("cpu", torch.float32, requires_grad=(phase == "backward"))
        checked = tried = 0
        fallbacks, notes = set(), set()
        for sample in samples:
            if max_samples and tried >= max_samples:
                break
            tried += 1
            try:
                status, info = _check_sample(op, sample, phase, device, metadata_only)
            except _CpuFailed as e:
                result["cpu_failed"] += 1
                result.setdefault("cpu_error", str(e))
                continue
            except _Skip as e:
                result.setdefault("skip_reason", str(e))
                continue
            except AssertionError as e:
                result.update(status="fail", error=str(e)[:300] if str(e).startswith(("mismatch", "output"))
                              else _short(e), sample=checked)
                break
            except Exception as e:
                result.update(status="fail", error=_short(e), sample=checked,
                              where=_where(e))
                break
            checked += 1
            fallbacks.update(info["fallbacks"])
            notes.update(info["notes"])
            result["metadata_only"] |= info["metadata_only"]
            if status == "fallback" and result["status"] != "fail":
                result["status"] = "fallback"
            elif result["status"] == "skip":
                result["status"] = "pass"
        result["samples"] = checked
        result["fallbacks"] = sorted(fallbacks)
        result["notes"] = sorted(notes)[:5]
        if result["status"] == "fail":
            _flush()
    except Exception as e:  # sample generation itself failed
        result.update(status="skip", skip_reason="sample_inputs: " + _short(e))
        _flush()
    return result


def _where(exc):
    """The innermost frame of the traceback inside ratex or tvm_lowering, for grouping failures."""
    frames = traceback.extract_tb(exc.__traceback__)
    for fr in reversed(frames):
        if "/ratex/" in fr.filename or "/tvm_lowering/" in fr.filename:
            return f"{os.path.relpath(fr.filename, ROOT)}:{fr.lineno} {fr.name}"
    return ""


# --------------------------------------------------------------------------- #
# worker processes
# --------------------------------------------------------------------------- #

def _worker_main(conn, max_samples):
    os.environ.setdefault("RATEX_CACHE_DIR", "")
    warnings.simplefilter("ignore")
    import torch

    torch.set_num_threads(1)
    import ratex  # noqa: F401
    all_entries = entries()
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        key, phase = msg
        t0 = time.time()
        try:
            res = check_entry(all_entries[key], phase, max_samples=max_samples)
        except BaseException as e:  # noqa: BLE001
            res = {"status": "fail", "error": "harness: " + _short(e)}
        res["seconds"] = round(time.time() - t0, 2)
        conn.send(("done", res))


class _Worker:
    def __init__(self, ctx, max_samples):
        self.parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, max_samples), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.task = None
        self.started = None
        self.done = 0

    def kill(self):
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.parent.close()

    def rss_gb(self):
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 2**20
        except OSError:
            pass
        return 0.0


def run_all(tasks, workers=2, max_samples=DEFAULT_MAX_SAMPLES, timeout=120.0, max_tasks=25,
            max_rss_gb=6.0, on_result=None, startup_timeout=180.0):
    """Run (key, phase) tasks in worker subprocesses; return {(key, phase): result}."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    env_backup = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "TVM_NUM_THREADS", "MKL_NUM_THREADS")}
    for k in env_backup:
        os.environ[k] = "1"
    pending = collections.deque(tasks)
    results = {}
    pool = []
    try:
        while pending or any(w.task for w in pool):
            # keep the pool full
            pool = [w for w in pool if w.proc.is_alive() or w.task]
            while len(pool) < workers and pending:
                w = _Worker(ctx, max_samples)
                w.started = time.time()
                pool.append(w)
            progressed = False
            for w in list(pool):
                now = time.time()
                if not w.ready:
                    if w.parent.poll():
                        try:
                            w.parent.recv()
                            w.ready = True
                        except EOFError:
                            w.kill()
                            pool.remove(w)
                            continue
                    elif not w.proc.is_alive() or now - w.started > startup_timeout:
                        w.kill()
                        pool.remove(w)
                        raise RuntimeError("a conformance worker failed to start")
                    else:
                        continue
                if w.task is None:
                    if not pending or w.done >= max_tasks:
                        w.parent.send(None)
                        w.kill()
                        pool.remove(w)
                        continue
                    w.task = pending.popleft()
                    w.started = now
                    w.parent.send(w.task)
                    progressed = True
                    continue
                res = None
                if w.parent.poll():
                    try:
                        _, res = w.parent.recv()
                    except (EOFError, OSError):
                        res = None
                if res is None:
                    if not w.proc.is_alive():
                        code = w.proc.exitcode
                        res = {"status": "fail",
                               "error": f"crash: worker died (exit code {code}"
                                        f"{', signal ' + str(-code) if code and code < 0 else ''})"}
                    elif now - w.started > timeout:
                        res = {"status": "fail", "error": f"timeout: more than {timeout:.0f} s"}
                    elif w.rss_gb() > max_rss_gb:
                        res = {"status": "fail", "error": f"memory: worker over {max_rss_gb} GB"}
                    if res is None:
                        continue
                    res["seconds"] = round(now - w.started, 2)
                    w.kill()
                    pool.remove(w)
                results[w.task] = res
                if on_result:
                    on_result(w.task, res)
                w.task = None
                w.done += 1
                progressed = True
            if not progressed:
                time.sleep(0.05)
    finally:
        for w in pool:
            w.kill()
        for k, v in env_backup.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return results


# --------------------------------------------------------------------------- #
# reporting
# --------------------------------------------------------------------------- #

def figures(table):
    """table: {"forward": {key: status}, "backward": {...}} -> percentages over non-skipped entries."""
    out = {}
    for phase in PHASES:
        st = [s for s in table.get(phase, {}).values() if s != "skip"]
        n = len(st) or 1
        c = collections.Counter(st)
        out[phase] = {"entries": len(st), "pass": c["pass"], "fallback": c["fallback"], "fail": c["fail"],
                      "skip": sum(1 for s in table.get(phase, {}).values() if s == "skip"),
                      "matching_pct": 100.0 * (c["pass"] + c["fallback"]) / n,
                      "lowered_pct": 100.0 * c["pass"] / n}
    return out


def _group_key(msg):
    msg = re.sub(r"0x[0-9a-f]+", "0x?", msg or "")
    msg = re.sub(r"\d+", "N", msg)
    msg = re.sub(r"'[^']*'", "'?'", msg) if msg.startswith("mismatch") else msg
    return msg[:90]


def print_report(table, details, top=20):
    fig = figures(table)
    print()
    for phase in PHASES:
        f = fig[phase]
        print(f"{phase:8s}: {f['entries']} entries ({f['skip']} skipped): pass {f['pass']}, "
              f"fallback {f['fallback']}, fail {f['fail']}")
    print()
    print(f"forward  matching (fallback allowed): {fig['forward']['matching_pct']:5.1f} %")
    print(f"backward matching (fallback allowed): {fig['backward']['matching_pct']:5.1f} %")
    print(f"forward  lowered, no fallback:        {fig['forward']['lowered_pct']:5.1f} %")
    print(f"backward lowered, no fallback:        {fig['backward']['lowered_pct']:5.1f} %")
    for phase in PHASES:
        groups = collections.defaultdict(list)
        for key, res in details.get(phase, {}).items():
            if res.get("status") == "fail":
                groups[_group_key(res.get("error", ""))].append(key)
        if not groups:
            continue
        print(f"\ntop {phase} failure causes:")
        for msg, keys in sorted(groups.items(), key=lambda kv: -len(kv[1]))[:top]:
            ex = ", ".join(sorted(keys)[:6]) + (", ..." if len(keys) > 6 else "")
            print(f"  {len(keys):4d}  {msg}\n        {ex}")
    for phase in PHASES:
        fb = collections.Counter()
        for res in details.get(phase, {}).values():
            if res.get("status") == "fallback":
                fb.update(res.get("fallbacks", []))
        if fb:
            print(f"\nmost common {phase} fallbacks (entries): "
                  + ", ".join(f"{k} {v}" for k, v in fb.most_common(15)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", help="comma-separated entry keys or op names (default: all float32 entries)")
    p.add_argument("--phase", choices=("forward", "backward", "both"), default="both")
    p.add_argument("--max-samples", type=int, default=DEFAULT_MAX_SAMPLES,
                   help="samples tried per entry and direction, 0 = all (default %(default)s)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per entry and direction")
    p.add_argument("--max-tasks", type=int, default=25, help="tasks per worker before it is replaced")
    p.add_argument("--max-rss-gb", type=float, default=6.0)
    p.add_argument("--write", action="store_true", help=f"write {os.path.relpath(EXPECTATIONS, ROOT)}"
                   " (merged into the existing file when --ops is given)")
    p.add_argument("--expectations", default=EXPECTATIONS)
    p.add_argument("--details", help="write per-entry results (errors, fallback counters, times) here")
    p.add_argument("--verbose", "-v", action="store_true", help="print each result as it comes")
    p.add_argument("--from-details", metavar="PATH",
                   help="run nothing: report on (and with --write, record) a --details file of an earlier run")
    a = p.parse_args(argv)

    if a.from_details:
        with open(a.from_details) as f:
            details = json.load(f)
        table = {ph: {k: r["status"] for k, r in sorted(details.get(ph, {}).items())} for ph in PHASES}
        print_report(table, details)
        if a.write:
            _write(a.expectations, table, None)
        return 0

    os.environ.setdefault("RATEX_CACHE_DIR", "")
    warnings.simplefilter("ignore")
    names = set(a.ops.split(",")) if a.ops else None
    ents = entries(names)
    if names:
        missing = [n for n in names if n not in ents and not any(op.name == n for op in ents.values())]
        if missing:
            print("no float32 OpInfo entry named:", ", ".join(sorted(missing)), file=sys.stderr)
    phases = PHASES if a.phase == "both" else (a.phase,)
    tasks = []
    for key, op in ents.items():
        for phase in phases:
            if phase == "backward" and not op.supports_autograd:
                continue
            tasks.append((key, phase))
    print(f"{len(ents)} entries, {len(tasks)} tasks, {a.workers} workers", flush=True)

    details = {ph: {} for ph in PHASES}
    t0 = time.time()
    count = [0]

    def on_result(task, res):
        key, phase = task
        details[phase][key] = res
        count[0] += 1
        if a.verbose:
            extra = res.get("error") or ", ".join(res.get("fallbacks", []))
            print(f"[{count[0]}/{len(tasks)} {time.time() - t0:6.0f}s] {phase:8s} {key:45s} "
                  f"{res['status']:8s} {res.get('seconds', 0):6.1f}s  {extra[:150]}", flush=True)
        elif count[0] % 50 == 0:
            print(f"  {count[0]}/{len(tasks)} done, {time.time() - t0:.0f} s", flush=True)
        if a.details and count[0] % 50 == 0:
            _dump(a.details, details)

    run_all(tasks, workers=a.workers, max_samples=a.max_samples, timeout=a.timeout,
            max_tasks=a.max_tasks, max_rss_gb=a.max_rss_gb, on_result=on_result)
    table = {ph: {k: details[ph][k]["status"] for k in sorted(details[ph])} for ph in PHASES}
    print(f"done in {time.time() - t0:.0f} s")
    print_report(table, details)

    if a.details:
        _dump(a.details, details)
    if a.write:
        _write(a.expectations, table, names)
    return 0


def _write(path, table, names):
    """Write the expectations file; with a subset of `names`, merge into the existing one."""
    old = {}
    if names and os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    out = {}
    for ph in PHASES:
        merged = dict(old.get(ph, {}))
        merged.update(table[ph])
        out[ph] = dict(sorted(merged.items()))
    with open(path, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {path}")


def _dump(path, details):
    with open(path, "w") as f:
        json.dump(details, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    sys.exit(main())
