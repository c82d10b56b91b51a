"""The lazy device's model API, as in Ratex and torch._lazy."""
import torch

from ...core import sync
from ...core.tensor import check_device, is_lazy


def lazy_device(index: int = 0) -> torch.device:
    """Return the lazy device, `lazy:0` (ratex has one: another index raises a ValueError)."""
    return check_device(torch.device("lazy", index))


def mark_step():
    """Compile and run everything pending on the lazy device as one program."""
    sync.mark_step()


def add_step_closure(fn, args=()):
    """Run fn(*args) after the next mark_step's execution finishes (e.g. to print a loss)."""
    sync.add_step_closure(fn, args)


def wait_device_ops():
    """Block until all work launched on the lazy device is done."""
    sync.wait_device_ops()


def is_lazy_tensor(t) -> bool:
    """Return whether `t` is a lazy tensor."""
    return is_lazy(t)


__all__ = ["lazy_device", "mark_step", "add_step_closure", "wait_device_ops", "is_lazy_tensor"]

