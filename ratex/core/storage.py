"""Storage: the current value of a base tensor, shared with its views, and the list of
storages whose value is pending (what the next sync computes).

The list lives here, beside the writes that add to it, so that a write needs nothing from
the sync layer above; `ratex/core/sync.py` takes the list at each mark_step.
"""
import os
import sys
import traceback
import weakref

from .. import config
from .ir import Node

# Storages whose value may still be uncomputed, in the order they became pending:
# a deterministic root order keeps the graph key stable from step to step.
_pending = []  # weak references, in order; compacted when long (see track)
_COMPACT_MIN = 100_000
_compact_at = _COMPACT_MIN


class Storage:
    """The current value of a base tensor, shared with its views; `version` counts writes."""

    __slots__ = ("value", "version", "prev", "__weakref__")

    def __init__(self, value):
        self.value = value
        self.version = 0
        self.prev = None  # the last computed value, restored if the step computing `value` fails
        node, idx = value
        if node.results[idx] is None:
            track(self)
            if config.SAVE_IR or config.DEBUG:  # dumps and recompile reports name the user's lines
                note_origin(node)

    def write(self, value):
        """Make `value` the current value; a pending one puts this storage on the pending list."""
        current = self.value
        if current[0].results[current[1]] is not None:
            self.prev = current
        self.value = value
        self.version += 1
        if value[0].results[value[1]] is None:
            track(self)
            if config.SAVE_IR or config.DEBUG:
                note_origin(value[0])

    def rebind(self):
        """After a sync, point at a fresh data leaf so the op graph behind it can be freed.

        A single-output node that is computed has let go of its inputs already; it
        is kept, so views that cached it and this storage name the same value (a
        buffer that two leaves name is never donated, see sync.donations).
        """
        node, idx = self.value
        data = node.results[idx]
        if data is not None and node.op is not None and (node.inputs or len(node.results) > 1):
            self.value = (Node.leaf(data, node.metas[idx]), 0)


def track(storage):
    """Remember a storage whose value was just replaced by a pending one."""
    global _compact_at
    _pending.append(weakref.ref(storage))
    if len(_pending) > _compact_at:
        # A long run with no mark_step: keep one reference per live pending storage, and
        # compact again only once the list has doubled (a storage written 100k times, or
        # 100k distinct pending ones, would otherwise compact on every write).
        live = pending_storages()
        _pending[:] = [weakref.ref(st) for st in live]
        _compact_at = max(_COMPACT_MIN, 2 * len(live))


def pending_storages() -> list:
    """Return the live storages whose value is not computed, in the order they became pending.

    The list keeps only their references: a loop that reads values between writes (LBFGS reads
    a scalar a few hundred times a step, and each read computes what it needs) would otherwise
    scan every write since mark_step at every read."""
    seen, out, keep = set(), [], []  # storages hash by identity
    for ref in _pending:
        st = ref()
        if st is not None and st not in seen:
            node, idx = st.value  # once per write since the last sync: no calls
            if node.results[idx] is None:
                seen.add(st)
                out.append(st)
                keep.append(ref)
    _pending[:] = keep
    return out


def take_pending() -> list:
    """Return the pending storages (as `pending_storages`) and start an empty list."""
    global _compact_at
    storages = pending_storages()
    _pending.clear()
    _compact_at = _COMPACT_MIN  # a threshold a long run raised ends with it
    return storages


# ---- where pending values come from (RATEX_SAVE_IR dumps name the user's lines) ----------
def _internal_dirs() -> tuple:
    """Directories of the packages whose frames are not the user's: ratex's own, and those of
    tvm_lowering, torch and tvm, read from sys.modules at the first dump (loaded by then).

    By directory, not by a "/ratex/" in the path: a checkout named ratex (tests/ in it)
    would otherwise hide the user's own frames.
    """
    global _internal
    if _internal is None:
        others = [sys.modules[n] for n in ("tvm_lowering", "torch", "tvm") if n in sys.modules]
        _internal = (_RATEX_DIR,) + tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in others)
    return _internal


_RATEX_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_internal = None


def note_origin(node):
    """Remember the user's frames that produced `node` (for RATEX_SAVE_IR dumps and RATEX_DEBUG
    reports)."""
    internal = _internal_dirs()
    frames = [f for f in traceback.extract_stack(limit=40)[:-2] if not f.filename.startswith(internal)]
    node.origin = [f"{f.filename}:{f.lineno} in {f.name}" for f in frames[-3:]]
