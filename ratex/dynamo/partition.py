"""Split a graph into maximal lowerable regions and the nodes that run in eager PyTorch.

A node is lowerable when `tvm_lowering` has a rule for its op, it mutates nothing, its
values are tensors, and its rule has not failed before (`refuse`). Usually that is
every node, and the graph is one region; otherwise torch's capability-based
partitioner groups the lowerable nodes into regions without cycles, and the
result is a driver: an fx graph whose nodes are calls of the regions' compiled
programs and the eager ops, in an order that respects every dependency.
"""
import heapq
import operator

import torch
from torch import fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

import tvm_lowering
from . import adapter, graphs

_refused = set()  # node keys whose rule failed while lowering or compiling: eager from then on


def node_key(node: fx.Node) -> tuple:
    """Return what a rule's outcome depends on: the op, its non-tensor arguments and its metas."""

    def freeze(a):
        if isinstance(a, fx.Node):
            return _meta(a.meta.get("val"))
        if isinstance(a, (list, tuple)):
            return tuple(freeze(x) for x in a)
        if isinstance(a, dict):
            return tuple((k, freeze(v)) for k, v in sorted(a.items()))
        return graphs.atom(a)

    return node.target, freeze(node.args), freeze(node.kwargs), _meta(node.meta.get("val"))


def _meta(val):
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), val.dtype)
    if isinstance(val, (tuple, list)):
        return tuple(_meta(v) for v in val)
    return type(val).__name__


def refuse(node: fx.Node):
    """Run nodes like `node` eagerly from now on (its rule failed)."""
    _refused.add(node_key(node))


def _is_tensors(val) -> bool:
    if isinstance(val, torch.Tensor):
        return True
    if isinstance(val, (tuple, list)):
        return len(val) > 0 and all(v is None or isinstance(v, torch.Tensor) for v in val)
    return False


def why_not(node: fx.Node):
    """Return why `node` cannot be lowered (a phrase), or None when it can."""
    if node.target is operator.getitem:
        return why_not(node.args[0]) if isinstance(node.args[0], fx.Node) else "a getitem of a constant"
    op = node.target
    if not isinstance(op, torch._ops.OpOverload):
        return f"{getattr(op, '__name__', op)} is not an ATen op"
    if op._schema.is_mutable:
        return "it writes one of its inputs"
    if not tvm_lowering.has_rule(op.__name__):
        return "no lowering rule"
    if not _is_tensors(node.meta.get("val")):
        return "it returns no tensor"
    for a in node.all_input_nodes:
        if not _is_tensors(a.meta.get("val")):
            return "it takes a value that is not a tensor"
    if node_key(node) in _refused:
        return "its rule failed for these arguments"
    return None


class _Support(OperatorSupportBase):
    def is_node_supported(self, submodules, node: fx.Node) -> bool:
        return node.op == "call_function" and why_not(node) is None


def regions(gm: fx.GraphModule) -> list:
    """Return the lowerable regions of `gm`'s graph, each a list of nodes in graph order."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    if all(why_not(n) is None for n in calls):
        return [calls] if calls else []
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    parts = CapabilityBasedPartitioner(gm, _Support(), allows_single_node_partition=True).propose_partitions()
    return sorted((sorted(p.nodes, key=order.__getitem__) for p in parts), key=lambda ns: order[ns[0]])


class Eager:
    """An op that runs in eager PyTorch inside the driver, counted as `aten::<op>` as the lazy path counts it."""

    def __init__(self, op):
        self.op = op
        self.counter = f"aten::{op.__name__}"
        self.__name__ = f"eager_{op.__name__.replace('.', '_')}"

    def __call__(self, *args, **kwargs):
        adapter.counts[self.counter] += 1
        return self.op(*args, **kwargs)


def region_io(nodes: list, keep) -> tuple:
    """(inputs, outputs) of a region: the nodes outside it that it reads, in first-use order, and
    its nodes that something outside it (or the graph's output) reads or that are in `keep`
    (new values of mutated inputs), in graph order."""
    inside = set(nodes)
    inputs = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside:
                inputs.setdefault(a, None)
    outputs = [n for n in nodes if n in keep or any(u not in inside for u in n.users)]
    return list(inputs), outputs


def driver(graph: fx.Graph, parts: list, compile_region, mutations: list) -> fx.GraphModule:
    """Return a GraphModule that computes `graph`: each region of `parts` is one call of
    `compile_region(nodes, inputs, outputs)` (a callable taking the inputs' tensors and
    returning the outputs'), the other ops run eagerly, and each (input position, value)
    pair of `mutations` is written back into that input once everything has run."""
    nodes = list(graph.nodes)
    kept = {value for _, value in mutations}
    order = {n: k for k, n in enumerate(nodes)}
    owner = {}
    for k, part in enumerate(parts):
        for n in part:
            owner[n] = k
    items, item_of = [], {}
    for n in nodes:
        if n.op == "call_function":
            key = ("r", owner[n]) if n in owner else ("n", n)
            if key not in item_of:
                item_of[key] = len(items)
                items.append(key)
            item_of[n] = item_of[key]
    deps = [set() for _ in items]
    for n in nodes:
        if n in item_of:
            for a in n.all_input_nodes:
                if a in item_of and item_of[a] != item_of[n]:
                    deps[item_of[n]].add(item_of[a])
    first = [min(order[n] for n in (parts[key[1]] if key[0] == "r" else [key[1]])) for key in items]
    users = [[] for _ in items]
    for k, ds in enumerate(deps):
        for d in ds:
            users[d].append(k)
    waiting = [len(ds) for ds in deps]
    ready = [(first[k], k) for k in range(len(items)) if not waiting[k]]
    heapq.heapify(ready)

    g = fx.Graph()
    env = {}
    for n in graph.find_nodes(op="placeholder"):
        env[n] = g.node_copy(n)
    for n in graph.find_nodes(op="get_attr"):  # constants AOTAutograd lifted onto the module
        env[n] = g.node_copy(n)
    done = 0
    while ready:
        _, k = heapq.heappop(ready)
        done += 1
        kind, what = items[k]
        if kind == "r":
            inputs, outputs = region_io(parts[what], kept)
            call = g.call_function(compile_region(parts[what], inputs, outputs), tuple(env[a] for a in inputs))
            for j, o in enumerate(outputs):
                env[o] = g.call_function(operator.getitem, (call, j))
        else:
            env[what] = g.node_copy(what, lambda a: env[a])
            if isinstance(what.target, torch._ops.OpOverload):
                env[what].target = Eager(what.target)
        for u in users[k]:
            waiting[u] -= 1
            if not waiting[u]:
                heapq.heappush(ready, (first[u], u))
    if done != len(items):
        raise RuntimeError("the partition of the graph has a cycle")
    args = list(graph.find_nodes(op="placeholder"))
    if mutations:
        g.call_function(write_back, (tuple(env[args[pos]] for pos, _ in mutations),
                                     tuple(env[v] if isinstance(v, fx.Node) else v for _, v in mutations)))
    out = graph.output_node().args[0]
    g.output(fx.node.map_arg(list(out) if isinstance(out, (tuple, list)) else [out], lambda a: env[a]))
    return fx.GraphModule(graph.owning_module or torch.nn.Module(), g)


def write_back(dsts: tuple, srcs: tuple):
    """Give each input of `dsts` its new value from `srcs`, except where the program already
    wrote it into the input's buffer (donated), in one foreach copy."""
    todo_d, todo_s = [], []
    with torch.no_grad():
        for dst, src in zip(dsts, srcs):
            if type(src) is not torch.Tensor:
                dst.fill_(src)  # a constant the graph computed at trace time
            elif src.data_ptr() != dst.data_ptr() or src.shape != dst.shape:
                todo_d.append(dst)
                todo_s.append(src)
            # else the program wrote the update into dst's own buffer (donated), or returned dst
            # itself: a program's output that starts where an input does, with its shape, is that
            # input (a non-contiguous input was given to the program as a copy at another address)
        if todo_d:
            torch._foreach_copy_(todo_d, todo_s)
