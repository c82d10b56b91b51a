"""Graph cut: from root values to a topologically ordered graph with a structural key.

The key is what the compiled program depends on: each node's op, non-tensor
arguments and output metas, how nodes connect, and the metas of the inputs.
Two steps with the same key run the same program on different data.
"""
import operator

import torch
from torch import fx

import tvm_lowering
from tvm_lowering.ops.bounds import SITE
from .ir import fill


class Graph:
    """A cut: `leaves` are input values, `nodes` op nodes in order, `roots` outputs;
    `leaf_pos` maps each leaf value to its position."""

    __slots__ = ("leaves", "nodes", "roots", "key", "leaf_pos")

    def __init__(self, leaves, nodes, roots, key, leaf_pos):
        self.leaves, self.nodes, self.roots, self.key, self.leaf_pos = leaves, nodes, roots, key, leaf_pos


def cut(roots: list) -> Graph:
    """Return the graph computing `roots` (values) from computed values.

    Runs at every sync over every node (45 in scripted LeNet-5, 756 in GPT), so the
    per-input work is written out inline, and nodes are
    their own dict keys (Node hashes by identity; an id() call per lookup costs more).
    """
    leaves, leaf_pos = [], {}
    nodes, node_pos = [], {}
    entries = []

    def leaf_ref(value):
        pos = leaf_pos.get(value)
        if pos is None:
            pos = leaf_pos[value] = len(leaves)
            leaves.append(value)
        return ~pos

    for root in roots:
        if root[0].results[root[1]] is not None or root[0] in node_pos:
            continue
        stack = [(root[0], False)]
        while stack:
            node, expanded = stack.pop()
            if node in node_pos:
                continue
            if not expanded:
                stack.append((node, True))
                for v in reversed(node.inputs):
                    if v[0].results[v[1]] is None and v[0] not in node_pos:
                        stack.append((v[0], False))
                continue
            refs = []
            for value in node.inputs:  # leaf_ref written out: this loop is the cut's hot spot
                src, idx = value
                if src.results[idx] is None:
                    refs.append((node_pos[src], idx))
                    continue
                pos = leaf_pos.get(value)
                if pos is None:
                    pos = leaf_pos[value] = len(leaves)
                    leaves.append(value)
                refs.append(~pos)
            refs = tuple(refs)
            node_pos[node] = len(nodes)
            nodes.append(node)
            entries.append((node.key, refs))
    root_refs = tuple([(node_pos[v[0]], v[1]) if v[0].results[v[1]] is None else leaf_ref(v) for v in roots])
    leaf_metas = tuple([v[0].metas[v[1]] for v in leaves])
    return Graph(leaves, nodes, list(roots), (leaf_metas, tuple(entries), root_refs), leaf_pos)


# ---- replaying a cut ------------------------------------------------------------------
# A training loop cuts the same graph step after step, out of new nodes: walking them and
# building the key is most of mark_step's own time, and the compile cache then compares the
# new key, tuple by tuple, with the last one. A graph's key describes its cut completely
# (each node's op, arguments and metas; each input as the position of a node or of a leaf;
# the roots), so the next cut of roots that match a recent key is found by following the key
# back from the roots, checking every node against it, with no walk, no new key, and the
# cache's own key object to look up.
_RECENT = 4  # keys tried, most recently cut or replayed first (a step that reads its loss cuts twice)
_recent = []


def replay(roots: list):
    """Return the graph of `roots` as `cut` would, if it has the key of a recent cut (see above),
    else None. `roots` as `cut` takes them: distinct values, none computed."""
    for k, key in enumerate(_recent):
        graph = _follow(key, roots)
        if graph is not None:
            if k:
                _recent.insert(0, _recent.pop(k))
            return graph
    return None


def remember(graph: Graph):
    """Keep `graph`'s key for `replay`."""
    _recent.insert(0, graph.key)
    del _recent[_RECENT:]


def forget():
    """Drop the keys `replay` tries (tests that count cuts start with none)."""
    _recent.clear()


def _follow(key, roots: list):
    """The graph of `roots` if it is `key`'s graph, or None. Each node is reached from a root or
    from a user that comes later in the key's order (it lists nodes inputs first), so one pass
    from the last node back finds them all; every node's key, inputs and computed-ness, every
    leaf's identity and meta, and the roots are checked, so a match is what `cut` would return."""
    leaf_metas, entries, root_refs = key
    if len(roots) != len(root_refs):
        return None
    nodes = [None] * len(entries)
    leaves = [None] * len(leaf_metas)
    for value, ref in zip(roots, root_refs):
        node, idx = value
        if type(ref) is int or ref[1] != idx or node.results[idx] is not None:
            return None  # cut's roots are never computed: a leaf ref cannot match
        q = ref[0]
        seen = nodes[q]
        if seen is None:
            nodes[q] = node
        elif seen is not node:
            return None
    for p in range(len(entries) - 1, -1, -1):
        node = nodes[p]
        node_key, refs = entries[p]
        if node is None or node.key != node_key:
            return None
        inputs = node.inputs
        if len(inputs) != len(refs):
            return None
        for value, ref in zip(inputs, refs):
            src, idx = value
            if type(ref) is int:  # leaf ~ref: computed data
                if src.results[idx] is None:
                    return None
                have = leaves[~ref]
                if have is None:
                    leaves[~ref] = value
                elif have[0] is not src or have[1] != idx:
                    return None
            else:
                if ref[1] != idx or src.results[idx] is not None:
                    return None
                seen = nodes[ref[0]]
                if seen is None:
                    nodes[ref[0]] = src
                elif seen is not src:
                    return None
    # cut keys nodes by identity and leaves by value: one object in two places is another graph
    if len(set(map(id, nodes))) != len(nodes) or None in leaves or len(set(leaves)) != len(leaves):
        return None
    for (node, idx), meta in zip(leaves, leaf_metas):
        if node.metas[idx] != meta:
            return None
    return Graph(leaves, nodes, list(roots), key, {v: k for k, v in enumerate(leaves)})


def _meta_tensor(meta, float32_as=torch.float32):
    if meta is None:
        return None
    dtype = float32_as if meta.dtype is torch.float32 else meta.dtype
    return torch.empty(meta.shape, dtype=dtype, device="meta")


def _stored(arg, float32_as):
    """`arg` with every torch.float32 in it (a `dtype=` argument) replaced by `float32_as`."""
    if arg is torch.float32:
        return float32_as
    if type(arg) in (list, tuple):
        return type(arg)(_stored(a, float32_as) for a in arg)
    return arg


def _check_view_dtype(call, node):
    """Raise a LoweringError (the node then runs eagerly, on float32 copies) for a bit-level view
    from or to float32 where float32 data are stored in another dtype: its bytes are not there."""
    src = node.inputs[0][0].metas[node.inputs[0][1]].dtype
    dst = node.metas[0].dtype
    if src is not dst and torch.float32 in (src, dst):
        raise tvm_lowering.LoweringError(call, f"a {src} -> {dst} view reinterprets bits that RATEX_USE_BF16 "
                                               "stores as bfloat16")


_VIEW_DTYPE = torch.ops.aten.view.dtype


def to_fx(graph: Graph, float32_as: torch.dtype = torch.float32) -> fx.Graph:
    """Return the graph as a torch.fx.Graph of ATen OpOverloads (for lowering and display).

    Each call node's meta has 'val' (meta tensors of its outputs), 'ratex_node' (the lazy IR
    node it came from) and the node's position in `graph.nodes`, by which a program's index
    checks name it (tvm_lowering.ops.bounds.SITE). `float32_as`: the dtype of the device data of
    float32 values (bfloat16 under RATEX_USE_BF16), written for float32 in every meta and `dtype=`
    argument, so that the program computes in it what the user sees as float32.
    """
    stored = float32_as is not torch.float32
    g = fx.Graph()
    env = {}
    for i, (node, idx) in enumerate(graph.leaves):
        p = g.placeholder(f"in{i}")
        p.meta["val"] = _meta_tensor(node.metas[idx], float32_as)
        env[(id(node), idx)] = p
    produced = {}

    def lookup(value):
        node, idx = value
        hit = env.get((id(node), idx))
        if hit is not None:
            return hit
        call = produced[id(node)]
        item = g.call_function(operator.getitem, (call, idx))
        item.meta["val"] = _meta_tensor(node.metas[idx], float32_as)
        env[(id(node), idx)] = item
        return item

    for pos, node in enumerate(graph.nodes):
        args, kwargs = fill(node.spec, [lookup(v) for v in node.inputs])
        if stored:
            args, kwargs = _stored(tuple(args), float32_as), {k: _stored(v, float32_as) for k, v in kwargs.items()}
        call = g.call_function(node.op, tuple(args), dict(kwargs))
        vals = [_meta_tensor(m, float32_as) for m in node.metas]
        call.meta["val"] = vals[0] if not node.multi else tuple(vals)
        call.meta["ratex_node"] = node
        call.meta[SITE] = pos
        if stored and node.op is _VIEW_DTYPE:
            _check_view_dtype(call, node)
        produced[id(node)] = call
        if not node.multi:
            env[(id(node), 0)] = call
    g.output(tuple(lookup(r) for r in graph.roots))
    return g
