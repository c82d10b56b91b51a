"""Per-kernel passes run once per distinct kernel in a process.

Schedule rules look at one PrimFunc at a time and give the same schedule to equal PrimFuncs.
The programs of a process share many kernels (a training step and the forward before it, the
step after an optimizer's state appears, a module sweep's samples), so a kernel's schedule is
remembered by its structure (and the target and pass settings it was made under) and given
again to an equal kernel of a later program instead of being made anew.
"""
import collections
import threading

import tvm
import tvm_ffi
from tvm import tirx


class Once:
    """Results of a per-kernel pass by kernel, at most `capacity` of them (least recently used out)."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._done = collections.OrderedDict()  # (tag, target, config, hash) -> [(kernel, result)]
        self._lock = threading.Lock()

    def _get(self, key, func):
        with self._lock:
            for kernel, result in self._done.get(key, ()):
                if tvm_ffi.structural_equal(kernel, func):
                    self._done.move_to_end(key)
                    return result
        return None

    def _put(self, key, func, result):
        with self._lock:
            self._done.setdefault(key, []).append((func, result))
            self._done.move_to_end(key)
            while len(self._done) > self.capacity:
                self._done.popitem(last=False)

    def wrap(self, pass_: tvm.transform.Pass, tag: str) -> tvm.transform.Pass:
        """`pass_`, a pass that changes each unscheduled PrimFunc on its own, run only on the
        kernels it has not seen (under `tag`, the target and the pass settings)."""

        @tvm.transform.module_pass(opt_level=0, name=f"Once({pass_.info.name})")
        def run(mod: tvm.IRModule, ctx) -> tvm.IRModule:
            where = (tag, str(tvm.target.Target.current(allow_none=True)), str(ctx.config))
            todo, done = {}, {}
            for gv, func in mod.functions.items():
                if not isinstance(func, tirx.PrimFunc) or (func.attrs is not None and func.attrs.get("tirx.is_scheduled")):
                    continue
                key = (*where, tvm_ffi.structural_hash(func))
                result = self._get(key, func)
                if result is None:
                    todo[gv] = (key, func)
                else:
                    done[gv] = result
            if todo:
                out = pass_(tvm.IRModule({gv: func for gv, (_, func) in todo.items()}, attrs=mod.attrs))
                for gv, (key, func) in todo.items():
                    self._put(key, func, out[gv])
                    done[gv] = out[gv]
            if not done:
                return mod
            funcs = {gv: done.get(gv, func) for gv, func in mod.functions.items()}
            return tvm.IRModule(funcs, attrs=mod.attrs, global_infos=mod.global_infos)

        return run


SCHEDULES = Once()
