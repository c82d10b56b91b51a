"""Why a graph compiled: each graph compiled after the first is compared with the closest one
compiled before it in the process, and the difference is named (torch_xla's PT_XLA_DEBUG).

The sync layer tells `compiled` about every graph that was not in the memory cache. That
costs a summary of the graph: its key (which the compile cache holds anyway), the user
lines that recorded its ops where they were noted (RATEX_DEBUG or RATEX_SAVE_IR), and the
user's frame at the sync point. The comparison itself runs only where it is asked for:
printed at once under RATEX_DEBUG, or by `reports()` (`ratex.debug.explain()`).

The causes, in the order they are told apart:
  "input shapes"  the same ops, connected the same way, on inputs of other shapes or dtypes;
  "constant"      the same ops and shapes, but a non-tensor argument (a scalar, a size)
                  differs: it is baked into the program;
  "live tensors"  another number of inputs or outputs: a tensor that is live at the sync
                  now and was not then (optimizer state appearing, a tensor kept from a step);
  "ops"           other ops: the first one that differs, with the user line that recorded it;
  "same graph"    a graph compiled before: the compile cache was cleared, or it evicted it.
"""
import collections
import difflib
import sys
import warnings

from .. import config
from . import storage
from .executor import graph_hash

_HISTORY = 256  # graphs kept to compare with; their keys are held by the compile cache anyway
_history = collections.deque(maxlen=_HISTORY)  # Summary of each graph compiled, oldest first
_reports = collections.deque(maxlen=_HISTORY)  # (summary, history before it), explained when read
_compiles = [0]  # compiles in this process (RATEX_WARN_COMPILES)
_numbers = [0]  # reports made so far
# Graphs whose op sequences agree less than this are not one graph with other live tensors
# (SequenceMatcher's ratio: 1.0 equal, 0.0 nothing in common).
_RELATED = 0.5


class Summary:
    """What the comparison needs of one compiled graph, without holding its nodes."""

    __slots__ = ("key", "hash", "ops", "origins", "sync", "how", "_hash")

    def __init__(self, graph, how):
        self.key = graph.key
        self.ops = tuple(entry[0][0] for entry in graph.key[1])
        self.origins = tuple(node.origin for node in graph.nodes)
        self.sync = user_frame()
        self.how = how
        self._hash = None

    @property
    def graph(self) -> str:
        """The graph's hash, as RATEX_SAVE_IR dumps name it."""
        if self._hash is None:
            self._hash = graph_hash(_KeyOnly(self.key))
        return self._hash


class _KeyOnly:
    __slots__ = ("key",)

    def __init__(self, key):
        self.key = key


class Recompile:
    """Why one graph compiled: `cause` (see the module doc), `details` (lines), the sync point's
    user frame `sync`, the graph's hash `graph`, and `closest`, the hash of the graph compiled
    before that it was compared with (None where it is the first)."""

    __slots__ = ("number", "sync", "graph", "ops", "closest", "closest_sync", "cause", "details", "how")

    def __init__(self, number, summary, closest, cause, details):
        self.number, self.sync, self.graph, self.ops = number, summary.sync, summary.graph, len(summary.ops)
        self.closest = closest.graph if closest is not None else None
        self.closest_sync = closest.sync if closest is not None else None
        self.cause, self.details, self.how = cause, details, summary.how

    def __str__(self):
        head = f"ratex: {self.how} graph {self.graph} ({self.ops} ops) at {self.sync}"
        if self.closest is None:
            return head + " (the first graph of the process)"
        why = f"  cause: {self.cause} (closest earlier graph: {self.closest}, compiled at {self.closest_sync})"
        return "\n".join([head, why] + [f"  {d}" for d in self.details])

    def __repr__(self):
        return f"Recompile(cause={self.cause!r}, graph={self.graph!r}, sync={self.sync!r})"


def compiled(graph, how: str = "compiled"):
    """Note that `graph` was not in the memory cache and was `how` ('compiled', or 'loaded'
    from the persistent cache); print why under RATEX_DEBUG, warn once after
    RATEX_WARN_COMPILES compiles. Returns None."""
    summary = Summary(graph, how)
    before = tuple(_history)
    _history.append(summary)
    if before:
        _numbers[0] += 1
        _reports.append((_numbers[0], summary, before))
        if config.DEBUG:
            print(explain(summary, before), file=sys.stderr, flush=True)
    if how == "compiled":
        _compiles[0] += 1
        if _compiles[0] == config.WARN_COMPILES and not config.DEBUG:
            _warn(summary)


def _warn(summary):
    where = summary.sync.rsplit(" in ", 1)[0]
    filename, _, lineno = where.rpartition(":")
    warnings.warn_explicit(
        f"ratex: {_compiles[0]} graphs compiled in this process; a step whose graph changes compiles "
        "every time. Set RATEX_DEBUG=1 to print why each one compiled (ratex.debug.explain() returns it)",
        UserWarning, filename or "<unknown>", int(lineno) if lineno.isdigit() else 0)


def reports() -> list:
    """Return a Recompile for each graph compiled (or loaded) after the first, oldest first."""
    for k, entry in enumerate(_reports):
        if not isinstance(entry, Recompile):  # explained once, when first asked for
            number, summary, before = entry
            _reports[k] = explain(summary, before)
            _reports[k].number = number
    return list(_reports)


def clear():
    """Forget the graphs compiled so far: the next one counts as the first. Returns None."""
    _history.clear()
    _reports.clear()


def explain(summary: Summary, before) -> Recompile:
    """Return why `summary`'s graph compiled, compared with the closest graph in `before`."""
    if not before:
        return Recompile(0, summary, None, "first graph", [])
    closest = _closest(summary, before)
    cause, details = _difference(summary, closest)
    return Recompile(0, summary, closest, cause, details)


def _closest(new: Summary, before) -> Summary:
    same_ops = [s for s in before if s.ops == new.ops]
    if same_ops:  # the most recent first: a loop compares with its own last graph
        return max(reversed(same_ops), key=lambda s: _agreement(new.key, s.key))
    return max(reversed(before), key=lambda s: difflib.SequenceMatcher(None, s.ops, new.ops, autojunk=False).ratio())


def _agreement(a, b) -> int:
    """How many parts of two keys of graphs with the same ops agree (inputs, nodes, outputs)."""
    return (sum(x == y for x, y in zip(a[0], b[0])) + sum(x == y for x, y in zip(a[1], b[1]))
            + (a[2] == b[2]))


def _difference(new: Summary, old: Summary):
    """(cause, detail lines) of what makes `new`'s key differ from `old`'s."""
    leaves, entries, roots = new.key
    old_leaves, old_entries, old_roots = old.key
    if new.ops == old.ops and [e[1] for e in entries] == [e[1] for e in old_entries]:
        if leaves != old_leaves:
            return "input shapes", _changed_inputs(leaves, old_leaves)
        metas = [k for k, (e, o) in enumerate(zip(entries, old_entries)) if e[0][2] != o[0][2]]
        specs = [k for k, (e, o) in enumerate(zip(entries, old_entries)) if e[0][1] != o[0][1]]
        if specs:
            k = specs[0]
            return "constant", [_constant(new, k, entries[k][0][1], old_entries[k][0][1])]
        if metas:  # same inputs and arguments, other outputs: a dtype or shape from elsewhere
            k = metas[0]
            return "input shapes", [f"{_op(new, k)}: output {_metas(old_entries[k][0][2])} -> {_metas(entries[k][0][2])}"]
        if roots != old_roots:
            return "live tensors", _live(new, old)
        return "same graph", ["compiled before: the compile cache was cleared, or it evicted the program"]
    matcher = difflib.SequenceMatcher(None, old.ops, new.ops, autojunk=False)
    if (len(leaves) != len(old_leaves) or len(roots) != len(old_roots)) and matcher.ratio() >= _RELATED:
        return "live tensors", _live(new, old) + _first_op(new, old, matcher)
    return "ops", _first_op(new, old, matcher)


def _changed_inputs(leaves, old_leaves) -> list:
    changed = [f"input {k}: {_meta(o)} -> {_meta(n)}" for k, (n, o) in enumerate(zip(leaves, old_leaves)) if n != o]
    return changed[:3] + ([f"... and {len(changed) - 3} more inputs"] if len(changed) > 3 else [])


def _constant(new: Summary, k: int, spec, old_spec) -> str:
    pairs = _differing_atoms(spec, old_spec)
    what = ", ".join(f"{o!r} -> {n!r}" for o, n in pairs[:3]) or f"{old_spec!r} -> {spec!r}"
    return f"{_op(new, k)}: argument {what}, a constant in the program"


def _differing_atoms(a, b) -> list:
    """(old, new) pairs where two argument templates of the same shape differ."""
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        out = []
        for x, y in zip(a, b):
            out += _differing_atoms(x, y)
        return out
    return [] if a == b else [(b, a)]


def _live(new: Summary, old: Summary) -> list:
    """Lines naming the inputs and outputs `new` has more (or fewer) of than `old`."""
    lines = []
    extra_in = len(new.key[0]) - len(old.key[0])
    if extra_in:
        gained = list((collections.Counter(new.key[0]) - collections.Counter(old.key[0])).elements())
        shown = ", ".join(_meta(m) for m in gained[:4]) + (", ..." if len(gained) > 4 else "")
        lines.append(_count(extra_in, "input")
                     + (f" (new: {shown})" if extra_in > 0 and gained else ""))
    extra_out = len(new.key[2]) - len(old.key[2])
    if extra_out:
        lines.append(_count(extra_out, "output") + " (tensors live at the sync)"
                     + _new_roots(new, old))
    if not lines:
        lines.append("other tensors are outputs (live at the sync)" + _new_roots(new, old))
    return lines


def _count(n: int, what: str) -> str:
    return f"{abs(n)} {'more' if n > 0 else 'fewer'} {what}{'s' if abs(n) != 1 else ''}"


def _new_roots(new: Summary, old: Summary) -> str:
    """Where the outputs `new` has and `old` lacks were recorded (by op), where that is known."""
    old_ops = collections.Counter(old.ops[r[0]] for r in old.key[2] if type(r) is tuple)
    frames = []
    for r in new.key[2]:
        if type(r) is not tuple:
            continue
        op = new.ops[r[0]]
        if old_ops[op]:
            old_ops[op] -= 1
            continue
        frames.append(_op(new, r[0]))
    return f"; new: {', '.join(frames[:3])}" if frames else ""


def _first_op(new: Summary, old: Summary, matcher) -> list:
    """A line naming the first op where the two graphs' op sequences part."""
    for tag, i1, _, j1, _ in matcher.get_opcodes():
        if tag == "equal":
            continue
        if tag == "delete":
            then = f", where this graph goes on with {_op(new, j1)}" if j1 < len(new.ops) else ""
            return [f"graph {old.graph} has {_short(old.ops[i1])} (its op {i1}) that this graph lacks{then}"]
        was = f", where graph {old.graph} has {_short(old.ops[i1])}" if tag == "replace" else \
            f", which graph {old.graph} lacks"
        return [f"first different op: {_op(new, j1)}{was}"]
    return []


def _op(summary: Summary, k: int) -> str:
    """Node `k` of the graph by op name, with the user line that recorded it where known."""
    return f"op {k} {_short(summary.ops[k])}" + (f" at {_origin(summary, k)}" if _origin(summary, k) else "")


def _origin(summary: Summary, k: int):
    """The user frame that recorded node `k`, or (for an intermediate value with no tensor of
    its own) the next node's that has one."""
    for origin in summary.origins[k:k + 8]:
        if origin:
            return origin[-1]
    return None


def _short(op: str) -> str:
    return op[len("aten::"):] if op.startswith("aten::") else op


def _meta(meta) -> str:
    if meta is None:
        return "None"
    return f"{str(meta.dtype).replace('torch.', '')}{list(meta.shape)}"


def _metas(metas) -> str:
    return ", ".join(_meta(m) for m in metas)


def user_frame() -> str:
    """The innermost frame of the caller's stack outside ratex, torch and tvm, as 'file:line in fn'."""
    internal = storage._internal_dirs()
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(internal) and not filename.startswith("<frozen"):
            return f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "(unknown)"


