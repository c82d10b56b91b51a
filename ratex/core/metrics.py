"""Counters and timers under the names torch._lazy users know."""
import collections
import contextlib
import time

_counters = collections.Counter()
_timers = collections.defaultdict(list)


def counter_inc(name: str, n: int = 1):
    """Add `n` to counter `name`."""
    _counters[name] += n


def counter_value(name: str):
    """Return the value of counter `name`, or None if it never moved."""
    return _counters.get(name)


def counter_names():
    """Return the names of all counters that have moved."""
    return [k for k, v in _counters.items() if v]


def add_sample(name: str, seconds: float):
    """Record one timing sample (seconds) for metric `name`."""
    _timers[name].append(seconds)


@contextlib.contextmanager
def timed(name: str):
    """Time the block into metric `name`."""
    start = time.perf_counter()
    try:
        yield
    finally:
        add_sample(name, time.perf_counter() - start)


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
    lines = []
    for name, samples in _timers.items():
        total = sum(samples)
        lines += [
            f"Metric: {name}",
            f"  TotalSamples: {len(samples)}",
            f"  Accumulator: {total * 1e3:.3f}ms",
            f"  Mean: {total / len(samples) * 1e3:.3f}ms",
        ]
    for name, value in _counters.items():
        lines += [f"Counter: {name}", f"  Value: {value}"]
    return "\n".join(lines)


def reset():
    """Clear all counters and timers."""
    _counters.clear()
    _timers.clear()
