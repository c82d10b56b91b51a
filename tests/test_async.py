"""Asynchronous execution: tracing overlaps execution; execution errors surface at the next sync
and leave the tensors of the failed step as they were."""
import os
import signal
import threading
import time

import pytest
import torch
import torch.nn.functional as F

import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex.core import executor, sync
from ratex.lazy_tensor_core.debug import metrics


def test_tracing_of_next_step_overlaps_execution(dev):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
        torch.nn.Linear(8 * 14 * 14, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10),
    ).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))

    def step():
        opt.zero_grad()
        loss = F.cross_entropy(model(x.to(dev)), y.to(dev))
        loss.backward()
        opt.step()
        lm.mark_step()
        return loss

    for _ in range(3):
        step()
    lm.wait_device_ops()
    metrics.reset()
    trace, start = 0.0, time.perf_counter()
    for _ in range(10):
        t = time.perf_counter()
        loss = step()
        trace += time.perf_counter() - t  # mark_step returns before the program has run
    lm.wait_device_ops()
    wall = time.perf_counter() - start
    _, execute, _ = metrics.metric_data("ExecuteTime")
    assert wall < trace + execute, (wall, trace, execute)
    assert torch.isfinite(loss.cpu())


def test_execution_error_surfaces_at_next_sync_and_rolls_back(dev, monkeypatch, wrap_programs):
    w = torch.ones(3).to(dev)
    lm.mark_step()
    w.add_(1)

    def failing(fn, inputs):
        raise IndexError("index 7 is out of bounds for dimension 0 with size 3")

    wrap_programs(failing)
    lm.mark_step()  # launches and returns; the failure is reported at the next sync point
    with pytest.raises(sync.ExecutionError, match=r"executing graph .* out of bounds"):
        lm.wait_device_ops()
    monkeypatch.undo()
    torch.testing.assert_close(w.cpu(), torch.ones(3))  # the failed step's write is rolled back
    w.mul_(5)
    lm.mark_step()
    torch.testing.assert_close(w.cpu(), torch.full((3,), 5.0))


def test_a_program_reading_a_failed_programs_output_fails_too(dev, monkeypatch, wrap_programs):
    """The second step reads w from the first while the first still runs (on the native runner,
    straight from its outputs), so it fails too; both steps' writes are rolled back."""
    w = torch.ones(3).to(dev)
    lm.mark_step()
    lm.wait_device_ops()
    runs = []

    def first_fails(fn, inputs):
        runs.append(len(runs))
        if len(runs) == 1:
            time.sleep(0.05)
            raise RuntimeError("injected failure")
        return fn(*inputs)

    wrap_programs(first_fails)
    w.add_(1)
    lm.mark_step()
    w.mul_(3)
    lm.mark_step()
    with pytest.raises(sync.ExecutionError, match="injected failure"):
        lm.wait_device_ops()
    monkeypatch.undo()
    torch.testing.assert_close(w.cpu(), torch.ones(3))
    w.add_(2)
    lm.mark_step()
    torch.testing.assert_close(w.cpu(), torch.full((3,), 3.0))


def test_tracing_runs_at_most_one_program_ahead(dev, wrap_programs):
    """mark_step waits for older programs once MAX_IN_FLIGHT are launched, so a loop that traces
    faster than it executes does not queue steps (and their inputs) without bound."""
    from ratex.core import launch

    w = torch.ones(3).to(dev)
    lm.mark_step()
    lm.wait_device_ops()
    most = []

    def slow(fn, inputs):
        time.sleep(0.05)
        return fn(*inputs)

    wrap_programs(slow)
    for _ in range(6):
        w.add_(1)
        lm.mark_step()
        most.append(sum(not job.done.is_set() for job in launch._in_flight))
    lm.wait_device_ops()
    assert max(most) == launch.MAX_IN_FLIGHT, most
    torch.testing.assert_close(w.cpu(), torch.full((3,), 7.0))


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt, as in a terminal, also where the suite was started with
    SIGINT ignored (a background job inherits that, and Python then installs no handler)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_ctrl_c_while_waiting_for_a_program_leaves_it_running(dev, wrap_programs, ctrl_c_raises):
    """A KeyboardInterrupt reaches a thread waiting for a long program (on the native runner,
    within its 0.2 s wait slices), not once the program is over; it still finishes, and its results are kept."""
    w = torch.ones(3).to(dev)
    lm.mark_step()
    lm.wait_device_ops()

    def slow(fn, inputs):
        time.sleep(2.0)
        return fn(*inputs)

    wrap_programs(slow)
    w.add_(1)
    lm.mark_step()
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        w.cpu()
    assert time.perf_counter() - start < 1.5  # long before the program ends
    torch.testing.assert_close(w.cpu(), torch.full((3,), 2.0))


def test_programs_on_both_workers_read_each_others_outputs(dev):
    """A program with an input without elements runs on the Python worker (csrc/runner.cc takes
    none); it reads w from the native runner's run before it, and the next native run reads its."""
    w, empty = torch.ones(8, 8).to(dev), torch.zeros(0).to(dev)
    lm.mark_step()
    expected = torch.ones(8, 8)
    for _ in range(5):
        w.mul_(1.5).add_(1)
        lm.mark_step()
        w.add_(empty.sum())
        lm.mark_step()
        expected = expected * 1.5 + 1
    torch.testing.assert_close(w.cpu(), expected)


@pytest.mark.cpu_only("the native runner runs CPU programs")
def test_cpu_programs_run_on_the_native_runner(dev):
    import tvm_ffi

    from ratex import config
    from ratex.core import launch

    if not config.NATIVE_RUNNER or tvm_ffi.get_global_func("ratex.runner.prepare", allow_missing=True) is None:
        pytest.skip("the native runner is off or not built")
    w = torch.ones(4).to(dev)
    lm.mark_step()
    lm.wait_device_ops()
    w.add_(1)
    lm.mark_step()
    assert launch._in_flight[-1].ticket is not None  # on the runner, not collected yet
    torch.testing.assert_close(w.cpu(), torch.full((4,), 2.0))
    assert launch._in_flight[-1].ticket is None  # reading w collected it


@pytest.mark.cpu_only("CUDA does not survive a fork")
def test_a_forked_child_runs_programs_of_its_own(dev):
    """The parent's worker thread (the native runner, or the Python one) does not exist in a forked
    child: the child starts one of its own, and both go on training. A program still running at
    the fork is waited for first: the child could never collect it."""
    w = torch.ones(3).to(dev)
    w.add_(1)
    lm.mark_step()  # in flight at the fork
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its result through the pipe, and never return into pytest
        code = 1
        try:
            w.mul_(3)
            lm.mark_step()
            os.write(write, repr(w.cpu().tolist()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    deadline = time.monotonic() + 120
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    with os.fdopen(read) as pipe:
        got = pipe.read()
    assert os.waitstatus_to_exitcode(done[1]) == 0 and got == "[6.0, 6.0, 6.0]", got
    w.mul_(5)
    lm.mark_step()
    torch.testing.assert_close(w.cpu(), torch.full((3,), 10.0))


@pytest.mark.cpu_only("the native runner runs CPU programs")
def test_the_runner_lets_go_of_python_inputs_on_the_collecting_thread(dev):
    """A torch tensor handed to a native run goes back through torch's DLPack deleter, which takes
    the GIL: it must die on the thread that collects the run, not on the runner thread (which then
    waited for the GIL several times a step)."""
    import gc
    import weakref

    import tvm_ffi

    from ratex import config

    if not config.NATIVE_RUNNER or tvm_ffi.get_global_func("ratex.runner.prepare", allow_missing=True) is None:
        pytest.skip("the native runner is off or not built")
    cpu = torch.randn(16)
    x = cpu.to(dev)
    data = x._device_data()
    assert type(data) is torch.Tensor  # device data from Python
    died_on = []
    weakref.finalize(data, lambda: died_on.append(threading.get_ident()))
    w = x * 2
    del x, data
    lm.mark_step()  # the run now holds the last reference
    time.sleep(0.3)  # it is over, not collected
    assert died_on == []
    torch.testing.assert_close(w.cpu(), cpu * 2)
    gc.collect()
    assert died_on == [threading.get_ident()]
