"""The lazy device's model API, as in Ratex, torch._lazy and torch_xla's xla_model."""
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ... import distributed
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


def sync_tensors(tensors):
    """Compute the pending values of the lazy tensors in `tensors` (any iterable; other objects
    are skipped) in one program, as torch._lazy.sync_multi; returns None."""
    values = [t._value() for t in tensors if is_lazy(t)]
    if values:
        sync.execute(values)


def to_cpu(data):
    """Return `data` (tensors in nested lists, tuples and dicts) with every lazy tensor replaced by
    a CPU copy, all computed in one sync. A tensor that appears twice is copied once, so ties
    survive; parameters stay parameters, and requires_grad is kept."""
    leaves, spec = tree_flatten(data)
    sync_tensors(leaves)
    copies = {}
    out = []
    for x in leaves:
        if is_lazy(x):
            cpu = copies.get(id(x))
            if cpu is None:
                cpu = copies[id(x)] = cpu_copy(x)
            x = cpu
        out.append(x)
    return tree_unflatten(out, spec)


def cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """Return a CPU copy of the lazy tensor `t`: a leaf, a Parameter where `t` is one, with its
    requires_grad."""
    cpu = t._to_cpu()  # one copy: `.cpu()` downloads and then copies again (aten._to_copy on the CPU)
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(cpu, requires_grad=t.requires_grad)
    return cpu.requires_grad_(True) if t.requires_grad else cpu


def save(data, file_or_path):
    """torch.save `data` (a state_dict, an optimizer's, any nesting of them) with every lazy
    tensor moved to the CPU first, all computed in one sync; returns None. The file loads with
    torch.load's defaults (weights_only=True), onto the CPU. For state larger than half the
    host's memory, `ratex.lazy_tensor_core.utils.serialization.save` moves one tensor at a time."""
    torch.save(to_cpu(data), file_or_path)


# Data parallelism through torch.distributed (ratex/distributed.py).
REDUCE_SUM, REDUCE_MUL, REDUCE_MIN, REDUCE_MAX = (
    distributed.REDUCE_SUM, distributed.REDUCE_MUL, distributed.REDUCE_MIN, distributed.REDUCE_MAX)
all_reduce = distributed.all_reduce
all_gather = distributed.all_gather
reduce_scatter = distributed.reduce_scatter
reduce_gradients = distributed.reduce_gradients  # averages across ranks; nothing to do in a world of one
xrt_world_size = distributed.world_size
get_ordinal = distributed.rank


def optimizer_step(optimizer, barrier: bool = False, optimizer_args=None, groups=None):
    """Run `optimizer.step(**optimizer_args)` after averaging the gradients across ranks
    (`reduce_gradients`, over `groups`), and `mark_step()` after it where `barrier` (a
    DeviceLoader marks steps itself); return what step returned, as torch_xla's xm.optimizer_step."""
    if groups is None:
        reduce_gradients(optimizer)
    else:
        reduce_gradients(optimizer, groups=groups)
    loss = optimizer.step(**(optimizer_args or {}))
    if barrier:
        mark_step()
    return loss


__all__ = ["lazy_device", "mark_step", "add_step_closure", "wait_device_ops", "is_lazy_tensor", "sync_tensors",
           "to_cpu", "save", "optimizer_step", "reduce_gradients", "all_reduce", "all_gather", "reduce_scatter",
           "xrt_world_size", "get_ordinal"]
