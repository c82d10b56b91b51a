"""A progress line for compiles that take a while: quiet for short ones and off a terminal."""
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
