"""torch.load onto the lazy device: `map_location='lazy'` (or torch.device('lazy'), {'cpu': 'lazy'}).

Lazy tensors are saved as the CPU tensors they hold (LazyTensor.__reduce_ex__), so a
file saved from the lazy device is a CPU checkpoint. torch.load gives each storage to
the deserializer registered for the location map_location names
(torch.serialization.register_package), then rebuilds each tensor as
`torch.empty(0, device=storage.device).set_(storage, offset, size, stride)`. The lazy
device has no storages, so its deserializer returns a storage that names the lazy
device and points at the CPU bytes (which it keeps alive), and `set_` of that storage
into a lazy tensor uploads the tensor's bytes. Every CPU-saved tensor, from lazy or
not, then loads onto the lazy device, as map_location='cuda' puts it on CUDA.
"""
import torch

from ..device import LAZY
from ..tensor import LazyTensor, check_device
from .eager import run as eager
from .registry import HANDLER, register

aten = torch.ops.aten
_PRIORITY = 40  # after torch's own devices; the registry sorts (priority, ...) tuples, so it must be unique


def _tag(storage):
    """Lazy tensors have no storages to tag: saved, they are CPU tensors."""
    return None


def _restore(storage, location: str):
    """The deserializer of location `location`: for the lazy device, a storage on it over
    `storage`'s CPU bytes; None for other devices."""
    if not location.startswith("lazy"):
        return None
    check_device(location)
    cpu = storage if storage.device.type == "cpu" else storage.cpu()
    alias = torch._C._construct_storage_from_data_pointer(cpu.data_ptr(), LAZY, cpu.nbytes())
    alias._ratex_cpu = cpu  # the bytes stay alive as long as the storage that points at them
    return alias


@register(aten.set_.source_Storage_storage_offset, tier=HANDLER)
def _set_from_storage(func, args, kwargs):
    """`t.set_(storage, offset, size, stride)` for a storage `_restore` made: the bytes, uploaded."""
    self, source = args[0], args[1]
    cpu = getattr(source, "_ratex_cpu", None)
    if type(self) is not LazyTensor or cpu is None:
        return eager(func, args, kwargs)
    names = ("storage_offset", "size", "stride")
    given = dict(zip(names, args[2:]), **kwargs)
    size = list(given["size"])
    stride = given.get("stride") or torch.empty(size, device="meta").stride()
    view = torch.empty(0, dtype=self.dtype).set_(cpu, given["storage_offset"], size, stride)
    self._assume(LazyTensor.from_cpu(view))
    return self


torch.serialization.register_package(_PRIORITY, _tag, _restore)
