"""Launching compiled programs: one worker thread runs them in order, off the tracing thread.

A launched program's outputs are `Pending` device data at once, so Python
traces step N+1 while step N runs (the Relax VM releases the GIL inside
kernels). Whatever needs the values themselves (`.cpu()`, `.item()`, an eager
fallback) waits for them with `resolve`. An error while executing is raised at
the next sync point (`raise_failures`), naming the graph and the error, and the
storages the failed step wrote go back to the values they had before it. So is an
index out of range, which a program reports in its index checks (bounds.py): its
job fails as it hands its outputs on, with an IndexOutOfRange.
RATEX_ASYNC=0, or `serialize(True)` (the profiler), runs programs inline.

The worker is the native runner's C++ thread (csrc/runner.cc) where the program
has a launcher (CPU, native library built), else a Python thread. A native job's
outputs reach its Pendings when the tracing thread collects it: when a Pending is
read, at the next launch once it is done, or at a drain; a later program takes an
earlier one's outputs straight from the runner, collected or not.
"""
import atexit
import collections
import contextlib
import os
import queue
import threading

import torch
import tvm_ffi

from .. import config
from . import bounds, metrics

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


class IndexOutOfRange(ExecutionError, IndexError):
    """A launched program met an index out of range (PyTorch raises IndexError for those);
    `detail` names the op and the index."""

    def __init__(self, detail: str, text: str = None):
        super().__init__(text or detail)
        self.detail = detail


def _reported(job, note: str = "") -> ExecutionError:
    """The error to raise for failed `job`, `note` ending its message. An index out of range is
    named first, by the op that read it, whichever program (this one, or one it read from) met it."""
    err = job.error
    if isinstance(err, IndexOutOfRange):
        return IndexOutOfRange(err.detail, f"ratex: {err.detail} (while executing {job.label}){note}")
    return ExecutionError(f"ratex: executing {job.label} failed: {type(err).__name__}: {err}{note}")


def reuse_donated(inputs, outs: list, donate) -> None:
    """Hand back an input's own tensor for each output written into its buffer.

    The output comes back from TVM as a new tensor viewing the input's buffer through DLPack,
    and that view keeps the input's tensor object alive. Kept as the next step's input, each
    step would add one link to a chain per updated parameter and optimizer state that is never
    freed (and that, once long, overflows the stack when it finally is). `inputs`: a sequence,
    or a dict of the inputs known by position.
    """
    get = inputs.get if isinstance(inputs, dict) else (lambda i: inputs[i] if i < len(inputs) else None)
    for i, j in donate:
        x, out = get(i), outs[j]
        if (x is not None and out is not x and type(x) is torch.Tensor and type(out) is torch.Tensor
                and out.data_ptr() == x.data_ptr() and out.dtype == x.dtype and out.shape == x.shape
                and out.stride() == x.stride()):
            outs[j] = x



class Job:
    """One launched program run: inputs in, outputs (or an error) out."""

    __slots__ = ("program", "inputs", "targets", "pendings", "outs", "error", "done", "restore", "lost", "label",
                 "ticket", "sites", "after", "donors")

    def __init__(self, program, inputs, targets, label, sites=None):
        """`sites`: the graph's nodes, which the program's index checks name by position."""
        self.program, self.inputs, self.targets, self.label, self.sites = program, inputs, targets, label, sites
        self.outs = self.error = self.ticket = None  # ticket: the native runner's, until collected
        self.after = ()  # earlier native jobs whose outputs this one read before they were collected
        self.donors = None  # a native run's inputs by position whose buffers it writes in place (reuse_donated)
        self.restore = _restore_ctx[0]
        self.lost = ()  # (id(node), index) of old values whose buffers the run writes in place
        self.pendings = [Pending(self, k) for k in range(len(targets))]
        self.done = _Done()

    def run(self):
        """Run the program here (the Python worker, or inline)."""
        try:
            inputs = [resolve(x) for x in self.inputs]
            with metrics.timed("ExecuteTime"):
                self.outs = self.program.run(inputs)
            self._check_indices()
            self._deliver()
        except BaseException as err:  # noqa: BLE001 - reported at the next sync point
            self._fail(err)
        finally:
            self.inputs = self.targets = self.pendings = self.sites = None
            self.done.set()

    def _deliver(self):
        for (node, idx), out, pending in zip(self.targets, self.outs, self.pendings):
            pending.data = out  # first: whoever sees `out` on the node can find it through the Pending too
            node.results[idx] = out  # replaces the Pending: later reads skip the indirection
            pending.job = None  # copies of the Pending elsewhere let go of the job
        self.restore = None

    def _check_indices(self, host=False):
        """Raise IndexOutOfRange where the program's index checks (its output after the roots')
        found an index out of range; the outputs are then garbage, read from clamped addresses.
        `host`: the checks are a host tensor, which the native library reads where it is loaded
        (numpy's reading costs more than the rest of collecting a run)."""
        sites, self.sites = self.sites, None
        if len(self.outs) > len(self.targets):
            rows = self.outs.pop()
            bad_row = _runner()[3] if host else None
            if bad_row is not None and bad_row(rows) < 0:
                return
            message = bounds.violation(rows, sites)
            if message is not None:
                raise IndexOutOfRange(message)

    def _fail(self, err):
        self.error = err
        _failed.append(self)

    def start(self, launcher):
        """Queue the run on the native runner (tracing thread). An input that an earlier
        native job will produce goes as `ticket << 20 | output index` (csrc/runner.cc)."""
        try:
            args, after = [], []
            for x in self.inputs:
                if type(x) is Pending:
                    job = x.job
                    if job is None:
                        x = x.data
                    elif job.ticket is not None:
                        x = job.ticket << _INDEX_BITS | x.index
                        after.append(job)
                    else:
                        x = x.get()  # a failed job's: raises its error, which this job then reports
                args.append(x)
            self.ticket = launcher(*args)
            self.after = tuple(after)
            if self.program.aliasing and self.program.donate:
                self.donors = {i: args[i] for i, _ in self.program.donate if type(args[i]) is torch.Tensor}
        except BaseException as err:  # noqa: BLE001 - reported at the next sync point, as run() does
            self._fail(err)
            self.targets = self.pendings = self.sites = None
            self.done.set()
        finally:
            self.inputs = None

    def collect(self):
        """Wait for a native run and hand its outputs to the Pendings (usually on the tracing
        thread; the Python worker, running a program that reads this one's output, may too)."""
        with _collecting:
            self._collect()
        self.done.wait()

    def _collect(self):
        ticket = self.ticket
        if ticket is None:  # not native, or collected already
            return
        wait, _, release, _ = _runner()
        try:
            got = wait(ticket, _WAIT_SLICE)
            while not got:  # back in Python now and then: a Ctrl-C raises here, leaving the job as it is
                got = wait(ticket, _WAIT_SLICE)
        except Exception as err:  # noqa: BLE001 - the run's error
            got = err
        self.ticket = None
        release(ticket)
        try:
            if isinstance(got, Exception):
                self._fail(got)
            else:
                got = got[:]
                metrics.record("ExecuteTime", got[0], got[1])
                self.outs = got[2:]
                if self.donors:
                    reuse_donated(self.donors, self.outs, self.program.donate)
                self._check_indices(host=True)
                for job in self.after:  # it ran on their outputs: garbage where they failed their checks
                    job._collect()
                    if job.error is not None:
                        raise job.error
                self._deliver()
        except BaseException as err:  # noqa: BLE001 - reported at the next sync point
            self._fail(err)
        finally:
            self.targets = self.pendings = self.sites = self.donors = None
            self.after = ()
            self.done.set()

    def finished(self) -> bool:
        """Whether the run is over (a native run that is: collected now). Never blocks: where
        another thread is collecting (the Python worker, running a program that reads this run's
        outputs), it is not over for this caller yet. The ticket is read under the collecting
        lock: the collector releases it, and the runner forgets a released ticket."""
        if self.ticket is not None and _collecting.acquire(blocking=False):
            try:
                if self.ticket is not None and _runner()[1](self.ticket):
                    self._collect()
            finally:
                _collecting.release()
        return self.done.is_set()

    def wait(self):
        """Block until the run is over (and collected)."""
        if self.ticket is not None:
            self.collect()
        # In slices, as the native wait: after some earlier work (test_rules before test_async),
        # a Ctrl-C reached a thread blocked in one long wait only once the program ended --
        # likely delivered to another thread; a slice brings this one back to Python.
        while not self.done.wait(_WAIT_SLICE):
            pass

    def forget_rollback(self, donated: list):
        """The buffers of these old values (node, index) are written in place: they can't be restored.

        Should the run fail, the tensors that held them keep the failed value,
        so reading them raises the error again instead of returning a buffer
        the program may have half overwritten (see `rollback`).
        """
        self.lost = {(id(node), idx) for node, idx in donated}

    def rollback(self):
        """Put the storages this failed run would have written back to their previous values."""
        lost = self.lost
        for storage, previous in self.restore or ():
            if previous is None or (id(previous[0]), previous[1]) in lost:
                continue
            if storage.value[0].results[storage.value[1]].__class__ is Pending:
                storage.value = previous

    def result(self, k):
        self.wait()
        if self.error is not None:
            raise _reported(self) from self.error
        return self.outs[k]


_done_changed = threading.Condition()  # Job completions, for the rare thread that waits on one


class _Done:
    """A job's completion flag: threading.Event's interface, without making a Condition and
    a Lock for every job (a native run is collected on the thread that then reads it)."""

    __slots__ = ("flag",)

    def __init__(self):
        self.flag = False

    def is_set(self) -> bool:
        return self.flag

    def set(self):
        with _done_changed:
            self.flag = True
            _done_changed.notify_all()

    def wait(self, timeout=None) -> bool:
        if self.flag:
            return True
        with _done_changed:
            return _done_changed.wait_for(self.is_set, timeout)


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


def read(data):
    """Return device data as `resolve` does, for a reader of its values (`.cpu()`, `.item()`): a
    failed program's error is raised as `raise_failures` raises it, its step rolled back."""
    if type(data) is not Pending:
        return data
    try:
        return data.get()
    except ExecutionError:
        raise_failures()  # raises the first failure not reported yet, if any
        raise


_queue = queue.Queue()
_failed = []
_worker = None
_INDEX_BITS = 20  # an input read from an earlier native run: ticket << 20 | output index
_WAIT_SLICE = 0.2  # seconds ratex.runner.wait blocks before Python gets to look at signals
_native = None
_collecting = threading.Lock()  # one thread at a time hands a native run's outputs over


def _runner():
    """(wait, done, release) of the native runner (csrc/runner.cc) and the host library's
    `bad_row` (csrc/host.cc; None in a library built before it), looked up at first use."""
    global _native
    if _native is None:
        _native = (*(tvm_ffi.get_global_func(f"ratex.runner.{name}") for name in ("wait", "done", "release")),
                   tvm_ffi.get_global_func("ratex.host.bad_row", allow_missing=True))
    return _native


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
    if not config.ASYNC or _serial[0] > 0:
        job.run()
        return
    if job.program.may_capture(job.inputs):  # capturing CUDA graphs: nothing else on the device meanwhile
        drain()
        job.run()
        return
    launcher = job.program.launcher()
    while _in_flight and (_in_flight[0].finished() or len(_in_flight) >= MAX_IN_FLIGHT):
        _in_flight.popleft().wait()
    _in_flight.append(job)
    if launcher is not None:
        job.start(launcher)
        return
    if _worker is None:
        _worker = threading.Thread(target=_work, name="ratex-executor", daemon=True)
        _worker.start()
    _queue.put(job)


def drain():
    """Wait until everything launched so far has run (native runs: and is collected)."""
    while _in_flight:
        _in_flight.popleft().wait()
    if _worker is not None:
        _queue.join()


def _start_afresh_in_child():
    """A forked child has none of the parent's threads: it starts a Python worker of its own
    (csrc/runner.cc makes a native runner of its own the same way)."""
    global _worker, _queue
    _worker = None
    _queue = queue.Queue()


# Nothing is in flight across a fork: a child could never collect the parent's runs.
os.register_at_fork(before=drain, after_in_child=_start_afresh_in_child)


@atexit.register
def _finish_at_exit():
    # A program still running while the interpreter shuts down TVM's runtime under
    # it aborts the process ("terminate called without an active exception").
    drain()


def raise_failures():
    """Raise the first execution error since the last sync, after rolling its tensors back."""
    for job in tuple(_in_flight):
        job.finished()  # a native run that is over reports its error only once collected
    if not _failed:
        return
    jobs = list(_failed)
    _failed.clear()
    for job in jobs:
        job.rollback()
    job = jobs[0]
    raise _reported(
        job,
        ". The tensors that step would have written keep their previous values, except those whose "
        "buffers it was writing in place (ENABLE_PARAM_ALIASING): reading them raises this error again."
    ) from job.error
