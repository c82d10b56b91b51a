"""Progress lines for compiles that take a while and for tuning: quiet off a terminal."""
import contextlib
import sys
import threading

from tqdm import tqdm

DELAY_S = 2.0


@contextlib.contextmanager
def compiling(label: str, stream=None):
    """Show an elapsed-time bar for the block if it runs longer than DELAY_S and `stream` is a terminal."""
    stream = stream or sys.stderr
    if not getattr(stream, "isatty", lambda: False)():
        yield
        return
    done = threading.Event()

    def show():
        if done.wait(DELAY_S):
            return
        with tqdm(desc=f"ratex: compiling {label}", bar_format="{desc} [{elapsed}]", file=stream, leave=False) as bar:
            while not done.wait(0.5):
                bar.refresh()

    thread = threading.Thread(target=show, name="ratex-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


@contextlib.contextmanager
def tuning(count: int, stream=None):
    """A bar over `count` kernels being tuned; yields fn(name) to call after each kernel.

    Tuning takes seconds per kernel, so the bar shows at once (on a terminal).
    """
    stream = stream or sys.stderr
    if not getattr(stream, "isatty", lambda: False)():
        yield lambda name: None
        return
    # mininterval=0: updates come seconds apart, each worth drawing
    with tqdm(total=count, desc="ratex: tuning kernels", unit="kernel", file=stream, leave=False, mininterval=0) as bar:

        def step(name):
            bar.set_postfix_str(name, refresh=False)
            bar.update()

        yield step
