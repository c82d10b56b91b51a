"""Index checks at run time: a program's check rows (tvm_lowering/ops/bounds.py) read back, and
an index out of range named the way PyTorch names it.

A compiled program that indexes with tensors returns one more output after its roots: a row
per checked index tensor, `site, sub, dim, low, high, max, ~min`. The job that ran it reads
the rows before it hands its outputs on (launch.py); `violation` returns the message of the
first row whose indices left [low, high), naming the op by the graph node at `site` (and, for
a `ratex.jit.script` forward, the TorchScript op at `sub` inside it).
"""
import os

import torch
import tvm

import tvm_lowering
from tvm_lowering.ops import script
from .device import backend


def violation(rows, nodes) -> str:
    """The message for the first check in `rows` (a program's check output, device data) whose
    indices were out of range, naming its op among `nodes` (the graph's nodes, by position);
    None where every index was in range."""
    return message(backend().view_cpu(rows).numpy(), lambda site, sub: _describe(nodes, site, sub))


def message(rows, describe) -> str:
    """The message for the first check in `rows` (check rows as a numpy array) whose indices were
    out of range, its op and the user's line named by `describe(site, sub)`; None where every
    index was in range."""
    bad = (rows[:, 5] >= rows[:, 4]) | (~rows[:, 6] < rows[:, 3])
    if not bad.any():
        return None
    site, sub, dim, low, high, largest, smallest = (int(x) for x in rows[int(bad.argmax())])
    smallest = ~smallest
    worst = largest if largest >= high else smallest
    where = f"dimension {dim} with size {high}" if dim >= 0 else f"a tensor of {high} elements"
    op, line = describe(site, sub)
    return (
        f"index out of range in self: index {worst} is out of bounds for {where} in {op} "
        f"(its indices range from {smallest} to {largest}; valid are {low} to {high - 1}), {line}"
    )


def _describe(nodes, site, sub) -> tuple:
    """(op name, where the user's code recorded it) of the node at `site` (and `sub` inside a script)."""
    node = nodes[site] if nodes is not None and 0 <= site < len(nodes) else None
    if node is None:
        return "an indexing op", "recorded at an unknown line"
    if sub >= 0:
        key = node.spec[0][0]
        op, source = script.lookup(key).sites.get(sub, ("an indexing op", ""))
        return f"{op} in the forward of ratex.jit.script", f"at {_user_frame(source)}"
    if node.origin:
        return str(node.op), f"recorded at {node.origin[-1]}"
    return str(node.op), "recorded at a line of yours that setting RATEX_SAVE_IR=<file> names"


_INTERNAL = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                  for m in (torch, tvm, tvm_lowering)) + (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)


def _user_frame(source: str) -> str:
    """The innermost frame outside ratex, torch and TVM in a TorchScript source range ('path(12): forward' lines)."""
    for line in source.splitlines():
        path, _, rest = line.partition("(")
        if path and not os.path.abspath(path).startswith(_INTERNAL):
            lineno, _, func = rest.partition("): ")
            return f"{path}:{lineno} in {func}"
    return "an unknown line"
