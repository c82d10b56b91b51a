"""Index bounds: data-dependent indices never reach memory out of bounds, and a program reports
the ones PyTorch would have refused.

A rule that reads or writes at indices held in a tensor passes them through `index` (or reads
with `take`). The access then stays in bounds whatever the indices hold: take's `clip`/`wrap`
modes, or a clamp to [0, size) that the caller's kernel reads. Where the importer collects
checks (`import_graph(checks=...)`), each such index tensor also gets one small reduction that
yields its largest index and the bitwise not of its smallest (`max(stack([i, ~i]))`: both in
one kernel, and ~i, unlike -i, never overflows). The program returns them all as one extra
output, an int64 tensor of ROW columns, one row per check:

    site, sub, dim, low, high, max, ~min

`site` is the caller's number for the fx node that indexed (its meta[SITE]; -1 where it has
none), `sub` that number inside a converted TorchScript forward the node calls (-1 for none),
`dim` the dimension indexed (-1: the flattened tensor) and [low, high) the indices PyTorch
accepts there (low = -size where negative indices count from the end). The rows are
self-describing, so a program loaded from the disk cache reports as a fresh compile does;
whoever reads the output (ratex/core/bounds.py) raises where min < low or max >= high.

The reduction is a kernel of its own rather than part of the kernel that uses the index:
FuseOps never merges a reduction with the injective gather or scatter reading the same
indices (their loop nests differ), and TVM treats take, gather and scatter kernels as
opaque, so not even an elementwise clamp fuses into them. It reads only the indices, which
are small next to the rows they select.
"""
import numpy as np
from tvm import relax

SITE = "ratex_site"  # fx node meta key: the caller's number for the node, which checks report
ROW = 7  # columns of a row of the check output (module doc)


def index(imp, idx, size, dim=0, wrap=False, clamp=True):
    """Return the indices `idx` (an integer tensor) for an access along a dimension of `size`,
    recording a check that they lie in [0, size), or in [-size, size) with `wrap`.

    With `clamp` the result is int64 in [0, size), negative indices first counted from the end
    (`wrap`); without it, `idx` as it is, for an access that keeps itself in bounds (take's
    modes, the host scatter loops of kit.py, which skip an index out of range).
    """
    if size == 0 and 0 not in _shape(idx):
        raise NotImplementedError("indexing a dimension of size 0 (every index is out of range)")
    record(imp, idx, size, dim, wrap)
    if not clamp:
        return idx
    idx = _int64(imp, idx)
    if wrap:
        idx = _emit(imp, relax.op.where(relax.op.less(idx, _int(0)), relax.op.add(idx, _int(size)), idx))
    return _emit(imp, relax.op.minimum(relax.op.maximum(idx, _int(0)), _int(max(size - 1, 0))))


def take(imp, x, idx, axis, wrap=False, dim=None):
    """Return `x` taken at indices `idx` along `axis`, each checked as `index` checks them (and
    reported for dimension `dim`, by default `axis`).

    take's own modes keep the read in bounds: `wrap` reads an in-range negative index as
    PyTorch does, `clip` the rest. A function that Relax's Gradient will differentiate
    (`imp.differentiable`) gets clamped indices instead: take's gradient scatters at the
    indices it is given, with no mode.
    """
    size = _shape(x)[axis]
    dim = axis if dim is None else dim
    if imp.differentiable:
        return _emit(imp, relax.op.take(x, index(imp, idx, size, dim, wrap), axis=axis, mode="clip"))
    record(imp, idx, size, dim, wrap)
    return _emit(imp, relax.op.take(x, idx, axis=axis, mode="wrap" if wrap else "clip"))


def record(imp, idx, size, dim=0, wrap=False, low=None):
    """Record a check that `idx` lies in [0, size) (with `wrap`: [-size, size); from `low` where
    given, as multilabel_margin_loss's -1 that ends a target list), where the importer collects
    checks; indices without elements need none."""
    if imp.checks is None or 0 in _shape(idx):
        return
    flat = _emit(imp, relax.op.reshape(idx, [-1])) if len(_shape(idx)) != 1 else idx
    both = _emit(imp, relax.op.max(relax.op.stack([flat, relax.op.bitwise_not(flat)], axis=0), axis=[1]))
    header = (imp.site, -1, dim, low if low is not None else -size if wrap else 0, size)
    imp.checks.append(([header], _emit(imp, relax.op.reshape(_int64(imp, both), [1, 2]))))


def nest(imp, rows, table):
    """Record the checks of a converted forward inlined here: `rows`, that forward's check output,
    and `table`, the headers its import listed; each is reported under the inlining node."""
    if imp.checks is None or not table:
        return
    ranges = _emit(imp, relax.op.strided_slice(rows, axes=[1], begin=[ROW - 2], end=[ROW]))
    imp.checks.append(([(imp.site, h[0], h[2], h[3], h[4]) for h in table], ranges))


def output(imp, table: list):
    """Return the check output of everything recorded (module doc), appending its headers to `table`."""
    headers = [h for hs, _ in imp.checks for h in hs]
    table.extend(headers)
    ranges = [r for _, r in imp.checks]
    ranges = ranges[0] if len(ranges) == 1 else _emit(imp, relax.op.concat(ranges, axis=0))
    head = relax.const(np.array(headers, dtype="int64").reshape(len(headers), ROW - 2), "int64")
    return _emit(imp, relax.op.concat([head, ranges], axis=1))


# Relax helpers of our own, not kit's: kit's loss helpers check their targets through this module.
def _emit(imp, expr):
    return imp.block_builder.emit(expr)


def _shape(x):
    return [int(s) for s in x.ty.shape.values]


def _int64(imp, x):
    return x if str(x.ty.dtype) == "int64" else _emit(imp, relax.op.astype(x, "int64"))


def _int(v):
    return relax.const(v, "int64")
