"""Lazy IR: nodes that record one ATen op each, and device-data leaves.

A value is a pair `(node, index)`. A node whose `op` is None is a leaf that
holds device data. An op node keeps its ATen OpOverload, an argument template
(`spec`) in which tensor arguments are `Slot(i)` markers for `inputs[i]`, and
the metas of its outputs, known at trace time. `key` is the node's local
structural identity (op's schema name, non-tensor arguments, output metas); the graph key
adds how nodes connect. Once a node's outputs are computed they are kept in
`results` and it stops holding on to its inputs.
"""
import math
from typing import NamedTuple

import torch


class Meta(NamedTuple):
    """Shape and dtype of a value; what the compiled code depends on."""

    shape: tuple
    dtype: torch.dtype


class Slot:
    """Marks the place of tensor input `i` inside an op's argument template.

    Slots are canonical (`slot(i)` always returns the same object), so specs
    hash and compare by identity at C speed.
    """

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i

    def __repr__(self):
        return f"%{self.i}"

    def __reduce__(self):
        return (slot, (self.i,))


_SLOTS = [Slot(i) for i in range(256)]


def slot(i: int) -> Slot:
    """Return the canonical Slot for input `i`."""
    while i >= len(_SLOTS):
        _SLOTS.append(Slot(len(_SLOTS)))
    return _SLOTS[i]


class Node:
    """One recorded ATen op (or a device-data leaf when `op` is None)."""

    __slots__ = ("op", "spec", "inputs", "metas", "multi", "key", "results", "origin", "__weakref__")

    def __init__(self, op, spec, inputs, metas, multi=False, key=None):
        """`key`: the node key, where the caller has it (shape.Out.key: one object per op,
        arguments and input metas); else it is made here."""
        self.op = op
        self.multi = multi
        self.spec = spec
        self.inputs = inputs
        self.metas = metas
        self.key = key if key is not None else (op_key(op) if op is not None else None, spec, metas)
        self.results = [None] * len(metas)
        self.origin = None  # user frames that recorded this node (kept only with RATEX_SAVE_IR)

    @classmethod
    def leaf(cls, data, meta: Meta) -> "Node":
        """Return a leaf node holding device `data` of the given meta (what __init__ makes of
        an op-less node, set directly: every sync makes one per written tensor)."""
        node = _new_object(cls)
        node.op = node.spec = node.origin = None
        node.multi = False
        node.inputs = ()
        node.metas = metas = (meta,)
        node.key = (None, None, metas)
        node.results = [data]
        return node

    def is_computed(self, index: int) -> bool:
        """Return whether output `index` already has device data."""
        return self.results[index] is not None

    def set_result(self, index: int, data):
        """Keep computed device data for output `index`; drop inputs once all are known."""
        results = self.results
        results[index] = data
        if len(results) == 1 or all(r is not None or m is None for r, m in zip(results, self.metas)):
            self.inputs = ()

    def __repr__(self):
        if self.op is None:
            return f"Data({self.metas[0]})"
        return f"{self.op}({self.spec})"


_new_object = object.__new__


def op_key(op) -> str:
    """The op's schema name ('aten::add.Tensor') as it appears in node keys: a string, whose hash
    Python caches (OpOverload.__hash__ is Python code, paid for every node of every graph key)."""
    name = _op_keys.get(id(op))
    if name is None:
        _op_keys[id(op)] = name = op.name()
        _ops_kept.append(op)  # ids stay valid while the op lives
    return name


_op_keys, _ops_kept = {}, []


def op_name(op) -> str:
    """Return an OpOverload's short name, e.g. 'add.Tensor'."""
    return op.__name__


ATOMS = frozenset((int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout))


class _NegativeZero:
    """Stands for -0.0 in argument templates. -0.0 == 0.0 and both hash alike, so a
    program compiled for `x / 0.0` would otherwise be reused for `x / -0.0`."""

    __slots__ = ()

    def __repr__(self):
        return "-0.0"

    def __reduce__(self):
        return (_negative_zero, ())


def _negative_zero():
    return NEG_ZERO


NEG_ZERO = _NegativeZero()
NAN = float("nan")  # the one NaN in templates: fresh NaN objects compare unequal, and no key would ever hit


def float_atom(x: float):
    """A template's stand-in for the float `x`: x itself, except -0.0 and NaN (see above)."""
    if x == 0.0:
        return NEG_ZERO if math.copysign(1.0, x) < 0 else x
    return NAN if x != x else x


def template(obj, tensors: list, is_tensor):
    """Return a hashable copy of `obj` with each tensor replaced by a Slot into `tensors`."""
    if type(obj) is float:
        return float_atom(obj)
    if type(obj) in ATOMS:
        return obj
    if is_tensor(obj):
        tensors.append(obj)
        return slot(len(tensors) - 1)
    if isinstance(obj, (list, tuple)):
        items = tuple(template(x, tensors, is_tensor) for x in obj)
        return items if isinstance(obj, tuple) else ("__list__", items)
    if isinstance(obj, dict):
        return ("__dict__", tuple((k, template(v, tensors, is_tensor)) for k, v in obj.items()))
    return obj


def fill(spec, values: list):
    """Inverse of `template`: rebuild the arguments with `values[i]` for each Slot(i)."""
    if type(spec) is Slot:
        return values[spec.i]
    if spec is NEG_ZERO:
        return -0.0
    if isinstance(spec, tuple):
        if spec and spec[0] == "__list__":
            return [fill(x, values) for x in spec[1]]
        if spec and spec[0] == "__dict__":
            return {k: fill(v, values) for k, v in spec[1]}
        return tuple(fill(x, values) for x in spec)
    return spec
