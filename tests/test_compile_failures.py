"""Compiling, when it goes wrong or talks: a graph that fails to compile has its failing node found
in few compiles and remembered across shapes; TVM's warnings go to the "ratex" logger, not stderr."""
import logging
import math
import os
import threading
import warnings

import pytest
import torch

import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex.core import executor, tvm_log
from ratex.core.tracing import eager
from ratex.lazy_tensor_core.debug import metrics

_SIN = "aten::sin"


@pytest.fixture
def sin_fails(monkeypatch):
    """From now on, compiling a graph that holds a sin raises in TVM, as a failing pass does;
    return the list of the node counts of every graph compiled (or tried)."""
    compile_, tried = executor._compile, []

    def failing(graph, *args):
        tried.append(len(graph.nodes))
        if any(n.op is torch.ops.aten.sin.default for n in graph.nodes):
            raise RuntimeError("InternalError: Check failed: injected failure of a pass")
        return compile_(graph, *args)

    monkeypatch.setattr(executor, "_compile", failing)
    eager.unlowerable.pop(_SIN, None)
    yield tried
    eager.unlowerable.pop(_SIN, None)


def _chain(x, links: int):
    """`links` elementwise ops on x with a sin in the middle."""
    for k in range(links):
        x = torch.sin(x) if k == links // 2 else x * 1.01 + 0.1 if k % 2 else x.tanh()
    return x


@pytest.mark.parametrize("links", [12])
def test_the_failing_node_is_found_in_log_n_compiles_and_remembered_for_new_shapes(dev, sin_fails, links):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one warning that sin runs on CPU
        for size in (3, 5):
            x = torch.randn(size)
            del sin_fails[:]
            got = _chain(x.to(dev), links)
            lm.mark_step()
            torch.testing.assert_close(got.cpu(), _chain(x, links))
            if size == 3:  # the search: halves, recursing into the failing one
                levels = math.ceil(math.log2(sin_fails[0]))
                assert sin_fails[0] > links and len(sin_fails) <= 2 * levels + 1, sin_fails
                assert metrics.counter_value("FailedCompile") <= levels + 1
            else:  # a new shape: sin runs eagerly from the start, the rest is one program each side of it
                assert len(sin_fails) == 2 and all(n < links for n in sin_fails), sin_fails
    assert metrics.counter_value("aten::sin.default") == 2
    assert metrics.counter_value("FailedCompile") <= levels + 1  # none after the first shape


def test_a_remembered_failure_keeps_to_its_op_arguments_and_dtypes(dev, sin_fails):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.sin(torch.randn(4).to(dev)).cpu()
    assert _SIN in eager.unlowerable
    metrics.reset()
    del sin_fails[:]
    x = torch.randn(6, dtype=torch.float64)
    got = torch.sin(x.to(dev) + 1)  # another dtype: not known to fail, so it is compiled (and fails) again
    torch.testing.assert_close(got.cpu(), torch.sin(x + 1))
    assert metrics.counter_value("FailedCompile") >= 1


def test_tvm_compile_warnings_go_to_the_ratex_logger_not_stderr(dev, tvm_kernels, capfd, caplog):
    caplog.set_level(logging.DEBUG, logger="ratex")
    torch.manual_seed(0)
    ref = torch.nn.Embedding(13, 3)
    emb = torch.nn.Embedding(13, 3).to(dev)
    emb.load_state_dict(ref.state_dict())
    ids = torch.tensor([12, 0, 5, 5])
    (emb(ids.to(dev)) * 3).sum().backward()  # TVM's LLVM codegen warns of a pragma in its embedding backward
    (ref(ids) * 3).sum().backward()
    lm.mark_step()
    torch.testing.assert_close(emb.weight.grad.cpu(), ref.weight.grad)
    assert metrics.counter_value("UncachedCompile")
    assert capfd.readouterr().err == ""
    tvm = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tvm: [")]
    assert tvm and all(r.levelno == logging.DEBUG for r in caplog.records if r.getMessage() in tvm), \
        [r.getMessage() for r in caplog.records]


def test_other_output_during_a_compile_still_reaches_stderr_and_errors_still_raise(capfd, caplog):
    caplog.set_level(logging.DEBUG, logger="ratex")
    tvm_line = b"[01:02:03] /project/src/relax/ir/block_builder.cc:67: Warning: BlockBuilder destroyed\n"
    with pytest.raises(RuntimeError, match="a real error"):
        with tvm_log.captured():
            with tvm_log.captured():  # nested: one capture
                os.write(2, tvm_line)
                worker = threading.Thread(target=os.write, args=(2, b"a thread's line\n"))
                worker.start()
                worker.join()
                os.write(2, b"unfinished ")  # a line left open when the compile ends
            raise RuntimeError("a real error")
    os.write(2, b"and ended after it\n")  # stderr is itself again
    err = capfd.readouterr().err
    assert "a thread's line\n" in err and "unfinished and ended after it\n" in err, err
    assert "BlockBuilder" not in err, err
    assert [r.getMessage() for r in caplog.records if "BlockBuilder" in r.getMessage()]
