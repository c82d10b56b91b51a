"""Progress lines: compiles (only slow ones) and tuning, on a terminal only."""
import io
import time

from ratex.core import progress


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_slow_block_on_a_terminal_shows_the_bar(monkeypatch):
    monkeypatch.setattr(progress, "DELAY_S", 0.05)
    out = _Terminal()
    with progress.compiling("a graph of 3 ops", stream=out):
        time.sleep(0.8)
    assert "ratex: compiling a graph of 3 ops" in out.getvalue()


def test_fast_block_or_no_terminal_prints_nothing(monkeypatch):
    monkeypatch.setattr(progress, "DELAY_S", 0.05)
    quiet = io.StringIO()  # not a terminal
    with progress.compiling("x", stream=quiet):
        time.sleep(0.3)
    fast = _Terminal()
    with progress.compiling("x", stream=fast):
        pass
    assert quiet.getvalue() == "" and fast.getvalue() == ""


def test_tuning_bar_counts_kernels_on_a_terminal_only():
    out, quiet = _Terminal(), io.StringIO()
    for stream in (out, quiet):
        with progress.tuning(2, stream=stream) as step:
            step("fused_add")
            step("matmul")
    assert "ratex: tuning kernels" in out.getvalue() and "2/2" in out.getvalue()
    assert "matmul" in out.getvalue() and quiet.getvalue() == ""
