"""Per-iteration profiling of the lazy device: where each mini-batch's time goes.

    with ratex.profiler.Profiler() as prof:
        for x, y in loader:
            with prof.region("forward"):
                loss = loss_fn(model(x), y)
            with prof.region("backward"):
                loss.backward()
            optimizer.step()
            lm.mark_step()
            prof.step()                 # ends the row of this mini-batch
    print(prof.table())
    prof.export_chrome_trace("trace.json")   # open in https://ui.perfetto.dev

One row per mini-batch, in milliseconds:

  <region>  wall time of each `prof.region(name)` block in the step
  trace     wall time of the step not spent in a sync: recording ops, plus
            whatever else the Python code did (data loading, the optimizer's
            Python). It is measured as wall time minus sync time, not inside the
            op dispatcher, so it is an upper bound on the tracing cost.
  lower     lazy IR -> Relax (only on a compile-cache miss)
  compile   Relax -> machine code (only on a miss)
  disk      loading from / saving to the persistent cache (RATEX_CACHE_DIR)
  execute   running the compiled programs
  other     the rest of the syncs: graph cut and key, cache look-up, eager fallbacks
  total     wall time of the step
  cache     compile-cache outcome of the step's syncs: miss (compiled),
            hit (memory), disk (persistent cache)

A sync is every point that runs pending work: mark_step, and .item(), .cpu(),
print() of a lazy tensor. With RATEX_PROFILE=1 a row is printed (to stderr)
at the end of every mark_step, no code change needed.

While a profiler is active (or RATEX_PROFILE=1), programs run before
mark_step returns, so each phase is timed on its own; without it, execution
of step N overlaps tracing of step N+1 (see ratex/core/launch.py).
"""
import contextlib
import json
import os
import sys
import threading
import time

from . import config
from .core import launch, metrics

__all__ = ["Profiler", "COLUMNS"]

_PHASES = {
    "LowerTime": "lower",
    "CompileTime": "compile",
    "PersistentCacheLoadTime": "disk",
    "PersistentCacheStoreTime": "disk",
    "ExecuteTime": "execute",
}
_EVENT_NAMES = {
    "Sync": "sync",
    "MarkStep": "mark_step",
    "LowerTime": "lower",
    "CompileTime": "compile",
    "PersistentCacheLoadTime": "cache load",
    "PersistentCacheStoreTime": "cache store",
    "ExecuteTime": "execute",
}
_CACHE_COUNTERS = (("UncachedCompile", "miss"), ("CachedCompile", "hit"), ("PersistentCacheHit", "disk"))
COLUMNS = ("trace", "lower", "compile", "disk", "execute", "other", "total")


class _Window:
    """Sums the sync phases between two step boundaries."""

    def __init__(self):
        self.start = time.perf_counter()
        self._counts = self._snapshot()
        self._clear()

    def _clear(self):
        self.sync = 0.0
        self.phases = dict.fromkeys(("lower", "compile", "disk", "execute"), 0.0)
        self.syncs = 0

    @staticmethod
    def _snapshot():
        return {name: metrics.counter_value(name) or 0 for name, _ in _CACHE_COUNTERS}

    def on_event(self, name, start, end):
        if name == "Sync":
            self.sync += end - start
            self.syncs += 1
        else:
            phase = _PHASES.get(name)
            if phase is not None:
                self.phases[phase] += end - start

    def close(self, now=None) -> dict:
        """Return this window's row (seconds) and start the next window at `now`."""
        now = time.perf_counter() if now is None else now
        counts = self._snapshot()
        cache = {}
        for name, label in _CACHE_COUNTERS:
            before, after = self._counts[name], counts[name]
            delta = after - before if after >= before else after  # metrics.reset() in between
            if delta:
                cache[label] = delta
        wall = now - self.start
        row = {
            "trace": max(wall - self.sync, 0.0),
            **self.phases,
            "other": max(self.sync - sum(self.phases.values()), 0.0),
            "total": wall,
            "syncs": self.syncs,
            "cache": cache,
        }
        self.start, self._counts = now, counts
        self._clear()
        return row


def _cache_text(cache: dict) -> str:
    if not cache:
        return "-"
    return " ".join(label if n == 1 else f"{n}x{label}" for label, n in cache.items())


def _format(rows, regions, header=True) -> str:
    cols = ["step", *regions, *COLUMNS, "cache"]
    cells = []
    for row in rows:
        line = [str(row["step"])]
        line += [f"{row['regions'].get(r, 0.0) * 1e3:.2f}" for r in regions]
        line += [f"{row[c] * 1e3:.2f}" for c in COLUMNS]
        line.append(_cache_text(row["cache"]))
        cells.append(line)
    widths = [max([len(c)] + [len(line[i]) for line in cells]) for i, c in enumerate(cols)]
    widths = [max(w, 8) if 0 < i < len(cols) - 1 else w for i, w in enumerate(widths)]

    def fmt(line):
        out = [line[0].rjust(widths[0])]
        out += [v.rjust(w) for v, w in zip(line[1:-1], widths[1:-1])]
        out.append(line[-1].ljust(widths[-1]))
        return "  ".join(out).rstrip()

    lines = [fmt(cols), fmt(["-" * w for w in widths])] if header else []
    return "\n".join(lines + [fmt(line) for line in cells])


class Profiler:
    """Per-mini-batch timing table and Chrome trace of the lazy device (see module doc).

    Use as a context manager; mark the end of each mini-batch with `step()`.
    Times are milliseconds in the table, seconds in `rows`.
    """

    def __init__(self):
        self.rows = []  # one dict per step: step, regions {name: s}, trace, lower, ..., total, cache
        self.events = []  # Chrome trace events (ts/dur in µs from the profiler's start)
        self._regions = {}  # name -> seconds, this step
        self._region_order = []
        self._window = None
        self._t0 = None
        self._step_t0 = None
        self._pid = os.getpid()

    # ---- lifecycle ------------------------------------------------------------------
    def __enter__(self):
        launch.serialize(True)  # phases are timed one after another: no overlap while profiling
        self._t0 = self._step_t0 = time.perf_counter()
        self._window = _Window()
        self._window.start = self._t0
        metrics.add_listener(self._on_event)
        return self

    def __exit__(self, *exc):
        launch.serialize(False)
        metrics.remove_listener(self._on_event)
        if self._window is not None and (self._regions or self._window.syncs):
            self.step()  # a last mini-batch that was not closed with step()
        self._window = None
        return False

    def _on_event(self, name, start, end):
        self._window.on_event(name, start, end)
        label = _EVENT_NAMES.get(name)
        if label is not None:
            self._event(label, "ratex", start, end, threading.get_ident())

    def _event(self, name, cat, start, end, tid, args=None):
        ev = {
            "name": name,
            "cat": cat,
            "ph": "X",
            "ts": round((start - self._t0) * 1e6, 3),
            "dur": round((end - start) * 1e6, 3),
            "pid": self._pid,
            "tid": tid,
        }
        if args:
            ev["args"] = args
        self.events.append(ev)

    # ---- user marks -----------------------------------------------------------------
    @contextlib.contextmanager
    def region(self, name: str):
        """Time the block as region `name` of the current mini-batch (a column of the table)."""
        if self._window is None:
            raise RuntimeError("Profiler.region() used outside `with Profiler() as prof:`")
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            if name not in self._regions and name not in self._region_order:
                self._region_order.append(name)
            self._regions[name] = self._regions.get(name, 0.0) + (end - start)
            self._event(name, "region", start, end, threading.get_ident())

    def step(self) -> dict:
        """End the current mini-batch: record its row (returned) and start the next."""
        if self._window is None:
            raise RuntimeError("Profiler.step() used outside `with Profiler() as prof:`")
        now = time.perf_counter()
        row = self._window.close(now)
        row = {"step": len(self.rows), "regions": self._regions, **row}
        self._regions = {}
        self.rows.append(row)
        args = {k: round(row[k] * 1e3, 3) for k in COLUMNS}
        args["cache"] = _cache_text(row["cache"])
        self._event(f"step {row['step']}", "step", self._step_t0, now, "mini-batches", args)
        self._step_t0 = now
        return row

    # ---- output ---------------------------------------------------------------------
    def table(self) -> str:
        """Return the per-mini-batch table (milliseconds), one row per step()."""
        return _format(self.rows, self._region_order)

    def __str__(self):
        return self.table()

    def export_chrome_trace(self, path: str):
        """Write the recorded spans as Chrome trace JSON (chrome://tracing, ui.perfetto.dev)."""
        meta = [
            {"name": "process_name", "ph": "M", "pid": self._pid, "tid": 0, "args": {"name": "ratex"}},
            {"name": "thread_name", "ph": "M", "pid": self._pid, "tid": "mini-batches",
             "args": {"name": "mini-batches"}},
        ]
        for tid in sorted({e["tid"] for e in self.events if isinstance(e["tid"], int)}):
            meta.append({"name": "thread_name", "ph": "M", "pid": self._pid, "tid": tid,
                         "args": {"name": "main" if tid == threading.main_thread().ident else f"thread {tid}"}})
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"traceEvents": meta + self.events, "displayTimeUnit": "ms"}, f)


# ---- RATEX_PROFILE=1: a row at every mark_step ----------------------------------------
class _StepPrinter:
    """Prints one table row per mark_step to `stream` (stderr), with a header the first time."""

    def __init__(self, stream=None):
        self.stream = stream
        self.window = _Window()
        self.count = 0

    def __call__(self, name, start, end):
        self.window.on_event(name, start, end)
        if name == "MarkStep":
            row = self.window.close(end)
            row.update(step=self.count, regions={})
            text = _format([row], (), header=self.count == 0)
            self.count += 1
            stream = self.stream or sys.stderr
            print(("ratex profile (ms):\n" if row["step"] == 0 else "") + text, file=stream, flush=True)


_printer = None


def _enable_env_profile():
    global _printer
    if _printer is None:
        launch.serialize(True)
        _printer = _StepPrinter()
        metrics.add_listener(_printer)


if config.PROFILE:
    _enable_env_profile()
