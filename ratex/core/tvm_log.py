"""TVM's C++ log lines go to the logger "ratex", not the terminal.

TVM's passes print warnings to the process's stderr while they compile ("Fast mode
segfaults when there are out-of-bounds indices", "Unknown pragma pragma_scope"):
notes for TVM's developers, noise to a user. TVM 0.27 has no hook to take them, so
while a compile runs (`captured`) file descriptor 2 is a pipe that a thread reads:
lines in TVM's log format ("[12:34:56] /path/file.cc:123: Warning: ...") are logged
at DEBUG to `logging.getLogger("ratex")`, every other line (another thread's output,
a crash report) goes on to the real stderr as it comes. Errors are not lost: TVM's
errors are Python exceptions, not log lines. RATEX_LOG_LEVEL=DEBUG shows them.
"""
import contextlib
import gc
import logging
import os
import re
import sys
import threading
import traceback

from .. import config

logger = logging.getLogger("ratex")
if config.LOG_LEVEL is not None:
    logger.setLevel(config.LOG_LEVEL)
    if not logger.handlers:
        _handler = logging.StreamHandler()
        _handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        logger.addHandler(_handler)

_TVM_LINE = re.compile(rb"^\[\d\d:\d\d:\d\d\] \S+:\d+: ")
_lock = threading.Lock()
_depth = 0
_state = None  # while captured: what `_stop` needs to put stderr back


def _forward(read_fd: int, real_fd: int, marker: bytes, drained: threading.Event):
    """Read the pipe to its end: TVM's lines to the logger, all other bytes to `real_fd` as they
    come; `drained` set when `marker` comes through (what was written before it is handled)
    or the reading ends."""
    buf, passing = b"", False  # passing: the current line is not TVM's and went on already
    real = os.fdopen(real_fd, "wb")  # buffered: it writes all it is given
    try:
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                buf += chunk
                while (end := buf.find(b"\n")) >= 0:
                    line, buf = buf[:end], buf[end + 1:]
                    if line.endswith(marker):  # perhaps after a line another thread left unfinished
                        real.write(line[:-len(marker)])
                        real.flush()
                        drained.set()
                    elif not passing and _TVM_LINE.match(line):
                        logger.debug("tvm: %s", line.decode(errors="replace"))
                    else:
                        real.write(line + b"\n")
                        passing = False
                if buf and (passing or buf[:1] not in (b"[", b"\0")):
                    # Not TVM's: on at once (a progress bar redraws its line, never ending it).
                    real.write(buf)
                    buf, passing = b"", True
                real.flush()
        real.write(buf)
    finally:
        real.close()
        drained.set()


def _start():
    sys.stderr.flush()
    read_fd, write_fd = os.pipe()
    saved, real = os.dup(2), os.dup(2)
    marker = b"\0ratex: tvm log drained"
    drained = threading.Event()
    thread = threading.Thread(target=_forward, args=(read_fd, real, marker, drained), name="ratex-tvm-log",
                              daemon=True)
    thread.start()
    os.dup2(write_fd, 2)
    return saved, write_fd, drained, marker


def _stop(state):
    saved, write_fd, drained, marker = state
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(saved)
    os.write(write_fd, marker + b"\n")
    os.close(write_fd)
    # A child process that inherited the pipe may hold it open: wait for what we wrote, not for its end.
    drained.wait()


@contextlib.contextmanager
def captured():
    """Within the block, route TVM's stderr log lines to the "ratex" logger (see module doc);
    nests and may be entered from several threads at once."""
    global _depth, _state
    with _lock:
        if _depth == 0:
            _state = _start()
        _depth += 1
    try:
        yield
    except BaseException as err:
        # A failed compile leaves TVM objects in the traceback's frames (a BlockBuilder with open
        # blocks), which print as they are freed: free them while their lines are still taken.
        seen, chained = set(), err
        while chained is not None and id(chained) not in seen:
            seen.add(id(chained))
            traceback.clear_frames(chained.__traceback__)
            chained = chained.__cause__ or chained.__context__
        gc.collect()
        raise
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                state, _state = _state, None
                _stop(state)
