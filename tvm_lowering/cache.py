"""The compile cache: compiled programs by graph key, in memory and on disk.

The memory tier holds whatever the caller makes of a compiled library (ratex
keeps its Programs there), least recently used first out. The disk tier, once
`attach`ed to a directory, keeps exported libraries for later processes
(disk_cache.py: atomic writes, size and sha256 checked before loading, LRU
eviction by size). An entry is named by the graph key, the compile options
and a salt of everything else that changes the generated code: TVM's version,
the target, the caller's version and a fingerprint of the code of tvm_lowering
and of the caller's packages. Beside the entries, a tunable target keeps its
MetaSchedule records (tuning.py); an entry compiled before its kernels were
tuned or retuned is out of date and compiles again.
"""
import collections
import functools
import hashlib
import os
import warnings
from typing import NamedTuple

import tvm

from . import codegen, disk_cache, pipeline, tuning
from .targets import Options, Target

_HERE = os.path.dirname(os.path.abspath(__file__))


class Built(NamedTuple):
    """A freshly compiled program: the executable, the (input, output) pairs it writes in place,
    what the tuning pass did, and the wall seconds of its pass pipeline and of its code
    generation ({"passes": s, "codegen": s}: pipeline.build)."""

    executable: object
    donated: tuple
    report: tuning.Report
    seconds: dict


class CompileCache:
    """Compiled programs by graph key: a memory LRU of `capacity` entries over an optional disk tier.

    A graph key is a deep tuple (hundreds of nested tuples for a LeNet-5 step) that Python
    hashes anew on every lookup. A training loop asks for the same key step after step, so
    the last hit is compared first: equality of two such keys mostly meets shared objects
    (op names, argument templates, metas) and costs less than hashing one.
    """

    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._entries = collections.OrderedDict()
        self._last = None  # (key, program) of the last hit: the most recently used entry
        self.disk = None  # the disk tier (disk_cache.DiskCache), once attached
        self.tuner = None  # the tuning database beside it (tuning.Tuner), for a tunable target
        self._attached = None  # attach's arguments
        self._named = (None, None, None)  # (key, options, entry name): a miss names its key twice
        self._store_warned = set()

    # ---- memory tier ------------------------------------------------------------------
    def get(self, key):
        """Return the program cached in memory under `key`, or None."""
        last = self._last
        if last is not None and last[0] == key:
            return last[1]
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self._last = (key, entry)
        return entry

    def put(self, key, program):
        """Store `program` in memory under `key`, evicting the least recently used entry when full."""
        self._last = None
        self._entries[key] = program
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self):
        """Drop every entry of the memory tier."""
        self._last = None
        self._entries.clear()

    def entries(self) -> list:
        """Return the memory tier's (key, program) pairs, least recently used first."""
        return list(self._entries.items())

    def __len__(self):
        return len(self._entries)

    # ---- disk tier --------------------------------------------------------------------
    def attach(self, root, target: Target, version: str = "", packages=(), size_limit: int = 1 << 30,
               tune: int = 0, cores: int = None):
        """Keep compiled programs in directory `root` too (None or "": memory only).

        `target` and `version` (the caller's) salt every entry, and so does the code of
        tvm_lowering and of `packages` (the caller's package directories). For a tunable
        target, `tune` > 0 tunes each kernel the records lack with that many trials, for
        programs that run on `cores` threads (tuning.Tuner). Asking again with the same
        arguments costs a comparison.
        """
        args = (root, target.key, version, tuple(packages), size_limit, tune, cores)
        if args == self._attached:
            return
        self._attached = args
        self._named = (None, None, None)
        self.disk = self.tuner = None
        if not root:
            return
        salt = "|".join([
            f"tvm={tvm.__version__}", f"target={target.key}", f"version={version}",
            f"code={_fingerprint((_HERE, *packages))}",
        ])
        self.disk = disk_cache.DiskCache(root, size_limit, salt)
        if target.tunable:
            # Records are replayed schedules: they are only good for the TVM and target that made them.
            tag = hashlib.sha256(f"{tvm.__version__}|{target.key}".encode()).hexdigest()[:16]
            self.tuner = tuning.Tuner(os.path.join(root, "tuning", tag), target.tvm, tune, cores)

    def _name(self, key, options: Options):
        """The disk entry name of `key` compiled with `options`, or None (no disk tier, or a key
        without a process-independent text)."""
        if self.disk is None:
            return None
        named = self._named
        if named[0] is key and named[1] == options:
            return named[2]
        name = self.disk.name((repr(options), key))
        self._named = (key, options, name)
        return name

    def persists(self, key, options: Options) -> bool:
        """Whether `store` will save the program of `key` compiled with `options` to disk."""
        return self._name(key, options) is not None

    def load(self, key, options: Options):
        """Return the library of `key` compiled with `options` from disk, or None (no disk tier, a
        miss, or an entry that is corrupt or compiled with other tuning records than now)."""
        name = self._name(key, options)
        if name is None:
            return None
        tuner = self.tuner
        accept = (lambda meta: tuner.is_current(meta.get("kernels"))) if tuner is not None else None
        return self.disk.load(name, accept=accept)

    # ---- compiling --------------------------------------------------------------------
    def build(self, mod: tvm.IRModule, target: Target, options: Options, donate=(), on_tune=None,
              dump=None, jit: bool = True) -> Built:
        """Compile `mod` for `target` (pipeline.build); with a tuner, its kernels are tuned first
        (`on_tune`: see Tuner.pass_) or given their records. `dump(mod, donated)`, the IR dump
        hook, sees each module compiled. `jit`: the executable runs in this process (False: it
        is `store`d and loaded back instead)."""
        donated = []
        report = tuning.Report()
        kernel_pass = self.tuner.pass_(report, on_tune) if self.tuner is not None else None
        seconds = {}
        executable = pipeline.build(mod, target, options, donate, donated, kernel_pass, jit, seconds)
        if dump is not None:
            dump(mod, donated)
        return Built(executable, tuple(donated), report, seconds)

    def store(self, key, options: Options, built: Built, info: dict = None):
        """Save `built` as the disk entry of `key` compiled with `options`, with `info` in its
        metadata; return the library loaded back, or None (not persisted, or saving failed:
        a full disk or a missing linker must not fail the step, so it warns once per directory)."""
        name = self._name(key, options)
        if name is None:
            return None
        try:
            meta = {**(info or {}), "salt": self.disk.salt, "kernels": built.report.kernels}
            with codegen.LLVM_OPTIONS:  # exporting makes machine code under the target's LLVM options
                path = self.disk.store(name, built.executable, meta)
            return tvm.runtime.load_module(path)
        except Exception as err:  # noqa: BLE001 - see the docstring
            if self.disk.root not in self._store_warned:
                self._store_warned.add(self.disk.root)
                warnings.warn(f"ratex compile cache: could not save to {self.disk.root}: {err}", stacklevel=3)
            return None


@functools.lru_cache(maxsize=None)
def _fingerprint(packages: tuple) -> str:
    return disk_cache.code_fingerprint(packages)
