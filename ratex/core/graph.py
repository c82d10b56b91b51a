"""Graph cut: from root values to a topologically ordered graph with a structural key.

The key is what the compiled program depends on: each node's op, non-tensor
arguments and output metas, how nodes connect, and the metas of the inputs.
Two steps with the same key run the same program on different data.
"""
import operator

import torch
from torch import fx

from .ir import fill


class Graph:
    """A cut: `leaves` are input values, `nodes` op nodes in order, `roots` outputs."""

    __slots__ = ("leaves", "nodes", "roots", "key")

    def __init__(self, leaves, nodes, roots, key):
        self.leaves, self.nodes, self.roots, self.key = leaves, nodes, roots, key


def _is_leaf(value) -> bool:
    node, idx = value
    return node.results[idx] is not None


def cut(roots: list) -> Graph:
    """Return the graph computing `roots` (values) from computed values."""
    leaves, leaf_pos = [], {}
    nodes, node_pos = [], {}
    entries = []

    def ref(value):
        node, idx = value
        if node.results[idx] is not None:
            k = (id(node), idx)
            pos = leaf_pos.get(k)
            if pos is None:
                pos = leaf_pos[k] = len(leaves)
                leaves.append(value)
            return ~pos
        return (node_pos[id(node)], idx)

    for root in roots:
        if _is_leaf(root) or id(root[0]) in node_pos:
            continue
        stack = [(root[0], False)]
        while stack:
            node, expanded = stack.pop()
            if id(node) in node_pos:
                continue
            if expanded:
                node_pos[id(node)] = len(nodes)
                nodes.append(node)
                entries.append((node.key, tuple(ref(v) for v in node.inputs)))
                continue
            stack.append((node, True))
            for v in reversed(node.inputs):
                if not _is_leaf(v) and id(v[0]) not in node_pos:
                    stack.append((v[0], False))
    root_refs = tuple(ref(r) for r in roots)
    leaf_metas = tuple(v[0].metas[v[1]] for v in leaves)
    return Graph(leaves, nodes, list(roots), (leaf_metas, tuple(entries), root_refs))


def _meta_tensor(meta):
    if meta is None:
        return None
    return torch.empty(meta.shape, dtype=meta.dtype, device="meta")


def to_fx(graph: Graph) -> fx.Graph:
    """Return the graph as a torch.fx.Graph of ATen OpOverloads (for lowering and display).

    Each call node's meta has 'val' (meta tensors of its outputs) and
    'ratex_node' (the lazy IR node it came from).
    """
    g = fx.Graph()
    env = {}
    for i, (node, idx) in enumerate(graph.leaves):
        p = g.placeholder(f"in{i}")
        p.meta["val"] = _meta_tensor(node.metas[idx])
        env[(id(node), idx)] = p
    produced = {}

    def lookup(value):
        node, idx = value
        hit = env.get((id(node), idx))
        if hit is not None:
            return hit
        call = produced[id(node)]
        item = g.call_function(operator.getitem, (call, idx))
        item.meta["val"] = _meta_tensor(node.metas[idx])
        env[(id(node), idx)] = item
        return item

    for node in graph.nodes:
        args, kwargs = fill(node.spec, [lookup(v) for v in node.inputs])
        call = g.call_function(node.op, tuple(args), dict(kwargs))
        vals = [_meta_tensor(m) for m in node.metas]
        call.meta["val"] = vals[0] if not node.multi else tuple(vals)
        call.meta["ratex_node"] = node
        produced[id(node)] = call
        if not node.multi:
            env[(id(node), 0)] = call
    g.output(tuple(lookup(r) for r in graph.roots))
    return g
