"""The lazy device's model API, as in Ratex and torch._lazy."""
import torch

from ... import distributed
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


# Data parallelism through torch.distributed (ratex/distributed.py).
REDUCE_SUM, REDUCE_MUL, REDUCE_MIN, REDUCE_MAX = (
    distributed.REDUCE_SUM, distributed.REDUCE_MUL, distributed.REDUCE_MIN, distributed.REDUCE_MAX)
all_reduce = distributed.all_reduce
all_gather = distributed.all_gather
reduce_scatter = distributed.reduce_scatter
reduce_gradients = distributed.reduce_gradients
optimizer_step = distributed.optimizer_step
xrt_world_size = distributed.world_size
get_ordinal = distributed.rank

__all__ = ["lazy_device", "mark_step", "add_step_closure", "wait_device_ops", "is_lazy_tensor",
           "all_reduce", "all_gather", "reduce_scatter", "reduce_gradients", "optimizer_step",
           "xrt_world_size", "get_ordinal"]

