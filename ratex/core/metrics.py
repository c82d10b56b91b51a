"""Counters and timers under the names torch._lazy users know."""
import collections
import contextlib
import time

_counters = collections.Counter()
counts = _counters  # `metrics.counts[name] += 1`: counter_inc without the call, for per-op hot paths
_timers = collections.defaultdict(list)
# Callables fn(name, start, end) (time.perf_counter() seconds) told about each timed block
# and span; the profiler listens here. Empty unless profiling, so timing costs nothing more.
_listeners = []


def counter_inc(name: str, n: int = 1):
    """Add `n` to counter `name`."""
    _counters[name] += n


# The names torch._lazy's C++ core gives the same counters (LTC documents use them).
ALIASES = {"CreateLtcTensor": "CreateLazyTensor", "DestroyLtcTensor": "DestroyLazyTensor"}


def counter_value(name: str):
    """Return the value of counter `name` (or of its LTC alias), or None if it never moved."""
    return _counters.get(ALIASES.get(name, name))


def counter_names():
    """Return the names of all counters that have moved, LTC aliases included."""
    names = [k for k, v in _counters.items() if v]
    return names + [alias for alias, name in ALIASES.items() if _counters.get(name)]


def add_sample(name: str, seconds: float):
    """Record one timing sample (seconds) for metric `name`."""
    _timers[name].append(seconds)


@contextlib.contextmanager
def timed(name: str):
    """Time the block into metric `name` (and tell listeners)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        record(name, start, time.perf_counter())


def record(name: str, start: float, end: float):
    """Record a block that ran from `start` to `end` (time.perf_counter() seconds) into metric
    `name`, as `timed` does (for blocks timed elsewhere: the native runner's program runs)."""
    _timers[name].append(end - start)
    for fn in tuple(_listeners):
        fn(name, start, end)


@contextlib.contextmanager
def span(name: str):
    """Tell listeners how long the block took, without keeping a metric (e.g. 'Sync')."""
    if not _listeners:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        end = time.perf_counter()
        for fn in list(_listeners):
            fn(name, start, end)


def add_listener(fn):
    """Call fn(name, start, end) at the end of every timed block and span."""
    _listeners.append(fn)


def remove_listener(fn):
    """Stop calling `fn` (no error if it was not listening)."""
    if fn in _listeners:
        _listeners.remove(fn)


def metric_names():
    """Return the names of all timers with samples."""
    return list(_timers)


def metric_data(name: str):
    """Return (count, total seconds, samples) for timer `name`, or None."""
    samples = _timers.get(name)
    if not samples:
        return None
    return len(samples), sum(samples), list(samples)


def metrics_report() -> str:
    """Return a human-readable report of all counters and timers."""
    return _report(list(_timers), list(_counters))


def _report(timers, counters) -> str:
    lines = []
    for name in timers:
        samples = _timers[name]
        total = sum(samples)
        lines += [
            f"Metric: {name}",
            f"  TotalSamples: {len(samples)}",
            f"  Accumulator: {total * 1e3:.3f}ms",
            f"  Mean: {total / len(samples) * 1e3:.3f}ms",
        ]
    for name in counters:
        lines += [f"Counter: {name}", f"  Value: {counter_value(name)}"]
    return "\n".join(lines)


# What short_metrics_report shows unless told otherwise: whether steps compiled, how long
# compiling and running took; every fallback (`aten::<op>`) is added, as torch_xla does.
SHORT_COUNTERS = ("MarkStep", "UncachedCompile", "CachedCompile", "PersistentCacheHit")
SHORT_METRICS = ("CompileTime", "ExecuteTime")


def short_metrics_report(counter_names=None, metric_names=None) -> str:
    """Return `metrics_report` restricted to the given counters and timers (default: compiles,
    steps, compile and execute time) plus every fallback counter `aten::<op>`."""
    counters = SHORT_COUNTERS if counter_names is None else counter_names
    timers = SHORT_METRICS if metric_names is None else metric_names
    counters = list(counters) + sorted(k for k in _counters if k.startswith("aten::") and k not in counters)
    return _report([t for t in timers if _timers.get(t)], [c for c in counters if counter_value(c)])


def reset():
    """Clear all counters and timers."""
    _counters.clear()
    _timers.clear()
