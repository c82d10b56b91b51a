"""Feeding the device: batches moved to the lazy device ahead of the step that uses them, and
the step marked for the user, as torch_xla's MpDeviceLoader.

    for x, y in ratex.data.DeviceLoader(loader, lm.lazy_device()):
        loss = F.nll_loss(model(x), y)      # x, y are on the device already
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()               # no mark_step: taking the next batch marks the step

A background thread takes batches from `loader` and moves their tensors to the device while
the current step is traced and run: the copy of the next batch happens off the tracing
thread (on GPU, a copy from pinned memory queued behind the running program). At most
`device_prefetch_size` batches wait on the device.
"""
import queue
import threading

import torch
from torch.utils._pytree import tree_map

from .lazy_tensor_core.core import lazy_model

_END = object()  # the loader is exhausted
_POLL = 0.1  # seconds the background thread waits on a full queue before looking at `stop` again


class DeviceLoader:
    """An iterable over `loader`'s batches with every tensor on `device`; each new batch after
    the first marks a step (`lm.mark_step()`) once `batches_per_execution` batches were taken
    since the last one, and the end of the data marks the last."""

    def __init__(self, loader, device=None, batches_per_execution: int = 1, device_prefetch_size: int = 4):
        device = torch.device(device) if device is not None else lazy_model.lazy_device()
        if device.type != "lazy":
            raise ValueError(f"DeviceLoader moves batches to the lazy device, not {device}; "
                             "pass lm.lazy_device() (or leave device out)")
        for name, value in (("batches_per_execution", batches_per_execution),
                            ("device_prefetch_size", device_prefetch_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DeviceLoader: {name}={value!r}; use a whole number of at least 1")
        self.loader = loader
        self.device = lazy_model.lazy_device(device.index or 0)
        self.batches_per_execution = batches_per_execution
        self.device_prefetch_size = device_prefetch_size

    def __iter__(self):
        return _Iterator(self)

    def __len__(self):
        return len(self.loader)


class _Iterator:
    def __init__(self, owner: DeviceLoader):
        self._per_step = owner.batches_per_execution
        self._taken = 0  # batches taken since the last mark_step
        self._queue = queue.Queue(maxsize=owner.device_prefetch_size)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=_feed, args=(iter(owner.loader), owner.device, self._queue, self._stop),
                                        name="ratex-device-loader", daemon=True)
        self._thread.start()

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        if self._taken >= self._per_step:  # the step that used the last batches is traced: run it
            lazy_model.mark_step()
            self._taken = 0
        item = self._queue.get()
        if item is _END or isinstance(item, _Failure):
            self._done = True
            if self._taken:  # the batches since the last mark_step were traced: run them
                lazy_model.mark_step()
            if item is _END:
                raise StopIteration
            raise item.error
        self._taken += 1
        return item

    def close(self):
        """Stop the background thread (a loop that breaks early leaves it waiting); returns None."""
        self._stop.set()
        self._done = True

    def __del__(self):
        self._stop.set()


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error):
        self.error = error


def _feed(batches, device, out: queue.Queue, stop: threading.Event):
    """The background thread: take each batch, move it to the device, queue it; then _END (or
    the loader's error)."""
    try:
        for batch in batches:
            moved = tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, batch)
            if not _put(out, moved, stop):
                return
        _put(out, _END, stop)
    except BaseException as err:  # noqa: BLE001 - raised in the iterating thread, at its next batch
        _put(out, _Failure(err), stop)


def _put(out: queue.Queue, item, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            out.put(item, timeout=_POLL)
            return True
        except queue.Full:
            continue
    return False


__all__ = ["DeviceLoader"]
