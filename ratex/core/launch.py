"""Launching compiled programs: one worker thread runs them in order, off the tracing thread.

A launched program's outputs are `Pending` device data at once, so Python
traces step N+1 while step N runs (the Relax VM releases the GIL inside
kernels). Whatever needs the values themselves (`.cpu()`, `.item()`, an eager
fallback) waits for them with `resolve`. An error while executing is raised at
the next sync point (`raise_failures`), naming the graph and the error, and the
storages the failed step wrote go back to the values they had before it.
RATEX_ASYNC=0, or `serialize(True)` (the profiler), runs programs inline.
"""
import atexit
import collections
import contextlib
import os
import queue
import threading

from . import metrics

# (storage, previous value) pairs of the mark_step in progress: every job it launches can roll them back
_restore_ctx = [()]


@contextlib.contextmanager
def rollback_point(pairs):
    """Jobs launched inside the block put `pairs` (storage, previous value) back if they fail."""
    _restore_ctx[0] = pairs
    try:
        yield
    finally:
        _restore_ctx[0] = ()


class ExecutionError(RuntimeError):
    """A launched program failed while running."""


class Job:
    """One launched program run: inputs in, outputs (or an error) out."""

    __slots__ = ("program", "inputs", "targets", "pendings", "outs", "error", "done", "restore", "label")

    def __init__(self, program, inputs, targets, label):
        self.program, self.inputs, self.targets, self.label = program, inputs, targets, label
        self.outs = self.error = None
        self.restore = _restore_ctx[0]
        self.pendings = [Pending(self, k) for k in range(len(targets))]
        self.done = threading.Event()

    def run(self):
        try:
            inputs = [resolve(x) for x in self.inputs]
            with metrics.timed("ExecuteTime"):
                self.outs = self.program.run(inputs)
            for (node, idx), out, pending in zip(self.targets, self.outs, self.pendings):
                pending.data = out  # first: whoever sees `out` on the node can find it through the Pending too
                node.results[idx] = out  # replaces the Pending: later reads skip the indirection
                pending.job = None  # copies of the Pending elsewhere let go of the job
            self.restore = None
        except BaseException as err:  # noqa: BLE001 - reported at the next sync point
            self.error = err
            _failed.append(self)
        finally:
            self.inputs = self.targets = self.pendings = None
            self.done.set()

    def forget_rollback(self, donated: list):
        """The buffers of these old values (node, index) are written in place: they can't be restored.

        Should the run fail, the tensors that held them keep the failed value,
        so reading them raises the error again instead of returning a buffer
        the program may have half overwritten.
        """
        lost = {(id(node), idx) for node, idx in donated}
        self.restore = [
            (st, None if prev is not None and (id(prev[0]), prev[1]) in lost else prev) for st, prev in self.restore
        ]

    def result(self, k):
        self.done.wait()
        if self.error is not None:
            raise ExecutionError(f"ratex: executing {self.label} failed: {self.error}") from self.error
        return self.outs[k]


class Pending:
    """Device data that a launched program will produce."""

    __slots__ = ("job", "index", "data")

    def __init__(self, job, index):
        self.job, self.index, self.data = job, index, None

    def get(self):
        job = self.job
        return self.data if job is None else job.result(self.index)


def resolve(data):
    """Return device data, waiting for the program that produces it if it is still running."""
    return data.get() if type(data) is Pending else data


ASYNC = os.environ.get("RATEX_ASYNC", "1").strip().lower() not in ("0", "false", "no", "off")
_queue = queue.Queue()
_failed = []
_worker = None


def _work():
    while True:
        job = _queue.get()
        try:
            job.run()
        finally:
            _queue.task_done()


_serial = [0]  # > 0 while something (the profiler) needs each program run before mark_step returns


def serialize(on: bool):
    """Run programs synchronously while `on` requests are outstanding (nestable)."""
    if on:
        drain()
        raise_failures()
    _serial[0] += 1 if on else -1


# Launched jobs not known to be done, oldest first. Tracing may run ahead of execution by
# this many programs, no more: a loop that traces faster than it executes would otherwise
# queue steps (and the inputs each one holds) without bound.
_in_flight = collections.deque()
MAX_IN_FLIGHT = 2


def launch(job):
    global _worker
    if not ASYNC or _serial[0] > 0:
        job.run()
        return
    if _worker is None:
        _worker = threading.Thread(target=_work, name="ratex-executor", daemon=True)
        _worker.start()
    while _in_flight and (_in_flight[0].done.is_set() or len(_in_flight) >= MAX_IN_FLIGHT):
        _in_flight.popleft().done.wait()
    _in_flight.append(job)
    _queue.put(job)


def drain():
    """Wait until the worker has run everything launched so far."""
    if _worker is not None:
        _queue.join()


@atexit.register
def _finish_at_exit():
    # A program still running while the interpreter shuts down TVM's runtime under
    # it aborts the process ("terminate called without an active exception").
    drain()


def raise_failures():
    """Raise the first execution error since the last sync, after rolling its tensors back."""
    if not _failed:
        return
    jobs = list(_failed)
    _failed.clear()
    for job in jobs:
        for storage, previous in job.restore or ():
            if storage.value[0].results[storage.value[1]].__class__ is Pending and previous is not None:
                storage.value = previous
    job = jobs[0]
    raise ExecutionError(
        f"ratex: executing {job.label} failed: {type(job.error).__name__}: {job.error}. "
        "The tensors that step would have written keep their previous values, except those whose "
        "buffers it was writing in place (ENABLE_PARAM_ALIASING): reading them raises this error again."
    ) from job.error
