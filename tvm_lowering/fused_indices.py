"""A workaround for TVM's iter-map simplifier, which gets some indices of fused loops wrong.

TVM's FlattenBuffer simplifies each flattened index with IterMapSimplify, which rewrites
`(x % K + c) // d`, for a constant c and a d that divides K, as `(x + c) % K // d`: wrong where
x % K + c wraps past K. With x = 0..11 and K = 6, `(x % 6 + 1) // 2` is 3 at x = 5 and the
rewrite gives 0 (`tests/test_fused_indices.py` shows it on TVM itself). Such an index appears
when a schedule fuses a kernel's loops into one (every GPU schedule does: a block binds
`v1 = fused % 6`) and the kernel reads at `(v1 - 1) // 2` or the like: the gradient of a strided
slice (`h[:, 1::2]`), of a padded pool. On an H100 the scripted `torch.stack` of GPT-J's
rotate_every_two then read its input gradient one row off (scripts/kernel_check.py found the kernel).

`guard_fused_indices` rewrites, after scheduling, each `e % K` in the block bindings of a kernel
that divides such a sum as `e - e // K * K`, the same number: TVM's simplifier folds it into the
indices before FlattenBuffer, where it leaves no `x % K + c` for the iter map to get wrong (it
gives `(x + c) // d - x // K * (K // d)` instead). TVM exposes no TIR mutator to Python, so the
kernel goes through its TVMScript, which is Python syntax: Python's `ast` finds the bindings and
rewrites their `%` nodes, and TVM parses the result back.
"""
import ast

import tvm
from tvm import tirx

_AXES = {"spatial", "reduce", "scan", "opaque"}  # T.axis.<kind>(domain, value)


def _binding(node) -> bool:
    """Whether `node` is a call `T.axis.<kind>(domain, value)`."""
    f = node.func if isinstance(node, ast.Call) else None
    return (isinstance(f, ast.Attribute) and f.attr in _AXES and isinstance(f.value, ast.Attribute)
            and f.value.attr == "axis" and len(node.args) == 2)


def _names(node) -> set:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _constant(node) -> bool:
    """Whether `node` is an integer literal or `T.int64(<literal>)`."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, int)
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.startswith("int") \
        and len(node.args) == 1 and isinstance(node.args[0], ast.Constant)


def _offset_sum(node) -> bool:
    """Whether `node` is a sum (+, -) with an integer constant among its terms."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub))):
        return False
    return any(_constant(side) or _offset_sum(side) for side in (node.left, node.right))


def _bound_by_mod(tree) -> tuple:
    """(names of block vars bound to an expression with `%`, those bindings' value nodes)."""
    names, values = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _binding(node.value):
            value = node.value.args[1]
            if any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) for n in ast.walk(value)):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
                values.append(node.value)
    return names, values


def at_risk(text: str) -> bool:
    """Whether a kernel's TVMScript `text` binds a block var with `%` and divides (`//`) a sum of
    that var and a constant: the index the iter map may get wrong."""
    if " % " not in text:
        return False
    tree = ast.parse(text)
    bound, _ = _bound_by_mod(tree)
    if not bound:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv) and _offset_sum(node.left) \
                and _names(node.left) & bound:
            return True
    return False


class _ModToSub(ast.NodeTransformer):
    def visit_BinOp(self, node):
        node = self.generic_visit(node)
        if isinstance(node.op, ast.Mod):  # e % k -> e - e // k * k (floormod of a positive k)
            floor = ast.BinOp(ast.BinOp(node.left, ast.FloorDiv(), node.right), ast.Mult(), node.right)
            return ast.BinOp(node.left, ast.Sub(), floor)
        return node


def guarded(text: str) -> str:
    """`text` with every `e % K` in its block bindings written `e - e // K * K`."""
    tree = ast.parse(text)
    _, values = _bound_by_mod(tree)
    for call in values:
        call.args[1] = _ModToSub().visit(call.args[1])
    return ast.unparse(ast.fix_missing_locations(tree))


@tvm.transform.module_pass(opt_level=0, name="RatexGuardFusedIndices")
def guard_fused_indices(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Rewrite the bindings of the scheduled kernels `at_risk` (see the module doc)."""
    for gv, func in list(mod.functions.items()):
        if not isinstance(func, tirx.PrimFunc):
            continue
        text = func.script()
        if not at_risk(text):
            continue
        try:
            fixed = tvm.script.from_source(guarded(text))
        except Exception as err:  # noqa: BLE001 - TVM's parser errors: the build fails naming the kernel
            raise RuntimeError(f"kernel {gv.name_hint} has fused-loop indices that TVM's FlattenBuffer may get wrong, "
                               f"and rewriting its bindings failed ({str(err).strip().splitlines()[-1]})") from err
        mod[gv] = fixed
    return mod
