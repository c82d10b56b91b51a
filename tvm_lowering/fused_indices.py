"""A workaround for TVM's iter-map simplifier, which gets some indices of fused loops wrong.

TVM's FlattenBuffer simplifies each flattened index with IterMapSimplify, which rewrites
`(x % K + c) // d`, for a constant c and a d that divides K, as `(x + c) % K // d`: wrong where
x % K + c wraps past K. With x = 0..11 and K = 6, `(x % 6 + 1) // 2` is 3 at x = 5 and the
rewrite gives 0 (`tests/test_fused_indices.py` shows it on TVM itself). Such an index appears
when a schedule fuses a kernel's loops into one (every GPU schedule does: a block binds
`v1 = fused % 6`) and the kernel reads at `(v1 - 1) // 2` or the like: the gradient of a strided
slice (`h[:, 1::2]`), of a padded pool. On an H100 the scripted `torch.stack` of GPT-J's
rotate_every_two then read its input gradient one row off (scripts/kernel_check.py found the kernel).

`guard_fused_indices` rewrites, after scheduling, each block binding `e % K` of a kernel that
reads or writes at such an index as `e - e // K * K`, which is the same number: TVM's simplifier
folds it into the indices before FlattenBuffer, where it leaves no `x % K + c` for the iter map
to get wrong (it gives `(x + c) // d - x // K * (K // d)` instead). TVM exposes no TIR mutator
to Python, so the kernel goes through its TVMScript text and back.
"""
import re

import tvm
from tvm import tirx

# A block binding whose value is `e % K`: "    v1 = T.axis.spatial(T.int64(6), (a + b) % T.int64(6))"
_BINDING = re.compile(r"^(?P<head>\s*(?P<var>\w+) = T\.axis\.\w+\((?:T\.int\d+\(\d+\)|\d+), )"
                      r"(?P<expr>.+) % (?P<k>T\.int\d+\(\d+\)|\d+)\)$", re.M)
_SUM = re.compile(r" [+-] ")
_CONSTANT = re.compile(r"T\.int\d+\(\d+\)|\b\d+\b")


def _divided_groups(text: str):
    """The parenthesized expressions of `text` that are divided (`(...) // d`)."""
    at = text.find(") // ")
    while at >= 0:
        depth, k = 0, at
        while k >= 0:
            depth += {")": 1, "(": -1}.get(text[k], 0)
            if depth == 0:
                yield text[k + 1:at]
                break
            k -= 1
        at = text.find(") // ", at + 1)


def at_risk(text: str) -> bool:
    """Whether a kernel's TVMScript `text` binds a block var to `e % K` and divides a sum of that
    var and a constant: the index the iter map may get wrong."""
    bound = {m.group("var") for m in _BINDING.finditer(text)}
    if not bound:
        return False
    body = "\n".join(line for line in text.splitlines() if "T.axis." not in line)
    for group in _divided_groups(body):
        if _SUM.search(group) and _CONSTANT.search(group) and any(re.search(rf"\b{re.escape(v)}\b", group) for v in bound):
            return True
    return False


def guarded(text: str) -> str:
    """`text` with every block binding `e % K` written `(e) - (e) // K * K`."""
    return _BINDING.sub(lambda m: f"{m['head']}({m['expr']}) - ({m['expr']}) // {m['k']} * {m['k']})", text)


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
