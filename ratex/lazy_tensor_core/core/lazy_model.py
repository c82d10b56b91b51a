"""The lazy device's model API, as in Ratex, torch._lazy and torch_xla's xla_model."""
import torch

from ...core import sync
from ...core.device import LAZY
from ...core.tensor import is_lazy


def lazy_device(index: int = 0) -> torch.device:
    """Return the lazy device, `lazy:0`."""
    if index != 0:
        raise ValueError(f"lazy device index {index} does not exist; ratex has one lazy device, index 0")
    return LAZY


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


def sync_tensors(tensors):
    """Compute the pending values of the lazy tensors in `tensors` (any iterable; other objects
    are skipped) in one program, as torch._lazy.sync_multi; returns None."""
    values = [t._value() for t in tensors if is_lazy(t)]
    if values:
        sync.execute(values)


__all__ = ["lazy_device", "mark_step", "add_step_closure", "wait_device_ops", "is_lazy_tensor", "sync_tensors"]
