"""Look at pending lazy graphs without running them.

    y = model(x)
    print(ratex.debug.graph_text([y]))        # one line per op
    open("g.dot", "w").write(ratex.debug.graph_dot([y]))   # dot -Tsvg g.dot > g.svg

Both cut the graph that a sync would compute for the given tensors (the same
`cut` mark_step uses) and only describe it: nothing is compiled or executed.
Values already computed appear as inputs.
"""
import torch

from .core.graph import Graph, cut
from .core.ir import fill

__all__ = ["graph_text", "graph_dot", "format_graph"]


class _Name:
    __slots__ = ("text",)

    def __init__(self, text):
        self.text = text

    def __repr__(self):
        return self.text


def _dtype(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _meta(meta) -> str:
    if meta is None:
        return "None"
    return f"{tuple(meta.shape)} {_dtype(meta.dtype)}"


def _arg(x) -> str:
    if isinstance(x, list):
        return "[" + ", ".join(_arg(v) for v in x) + "]"
    if isinstance(x, tuple):
        return "(" + ", ".join(_arg(v) for v in x) + ("," if len(x) == 1 else "") + ")"
    if isinstance(x, torch.dtype):
        return _dtype(x)
    return repr(x)


def _names(graph: Graph):
    """Return {(id(node), index): '%k' or '%k.i'} for every value of the graph, and node numbers."""
    names, number = {}, {}
    for i, (node, idx) in enumerate(graph.leaves):
        names[(id(node), idx)] = f"%{i}"
    base = len(graph.leaves)
    for j, node in enumerate(graph.nodes):
        k = base + j
        number[id(node)] = k
        for idx in range(len(node.metas)):
            names.setdefault((id(node), idx), f"%{k}.{idx}" if node.multi else f"%{k}")
    return names, number


def _call(node, names) -> str:
    args, kwargs = fill(node.spec, [_Name(names[(id(n), i)]) for n, i in node.inputs])
    parts = [_arg(a) for a in args] + [f"{k}={_arg(v)}" for k, v in kwargs.items()]
    return f"{node.op}({', '.join(parts)})"


def format_graph(graph: Graph) -> str:
    """Return the graph as text: one line per input and op, then the outputs."""
    names, _ = _names(graph)
    lines = [f"{names[(id(n), i)]} = input  -> {_meta(n.metas[i])}" for n, i in graph.leaves]
    base = len(graph.leaves)
    for j, node in enumerate(graph.nodes):
        outs = ", ".join(_meta(m) for m in node.metas)
        lines.append(f"%{base + j} = {_call(node, names)}  -> {outs}")
    lines.append("return " + ", ".join(names[(id(n), i)] for n, i in graph.roots))
    return "\n".join(lines)


def _dot_label(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def format_dot(graph: Graph) -> str:
    """Return the graph in Graphviz dot."""
    names, number = _names(graph)
    leaf_no = {(id(n), i): k for k, (n, i) in enumerate(graph.leaves)}
    out = ["digraph ratex {", "  rankdir=TB;", '  node [fontname="monospace", fontsize=10];']
    for k, (n, i) in enumerate(graph.leaves):
        out.append(f'  v{k} [shape=ellipse, label="%{k} input\\n{_dot_label(_meta(n.metas[i]))}"];')
    for node in graph.nodes:
        k = number[id(node)]
        metas = ", ".join(_meta(m) for m in node.metas)
        out.append(f'  v{k} [shape=box, label="%{k} {_dot_label(str(node.op))}\\n{_dot_label(metas)}"];')
        for n, i in node.inputs:
            src = leaf_no.get((id(n), i))
            src = src if src is not None else number[id(n)]
            label = f' [label="{i}"]' if n.multi else ""
            out.append(f"  v{src} -> v{k}{label};")
    out.append('  out [shape=doublecircle, label="return"];')
    for pos, (n, i) in enumerate(graph.roots):
        src = leaf_no.get((id(n), i))
        src = src if src is not None else number[id(n)]
        out.append(f'  v{src} -> out [label="{pos}"];')
    out.append("}")
    return "\n".join(out)


def _graph_of(tensors) -> Graph:
    from .core.tensor import LazyTensor  # noqa: PLC0415

    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    values = []
    for t in tensors:
        if not isinstance(t, LazyTensor):
            raise TypeError(f"expected lazy tensors, got a tensor on {getattr(t, 'device', type(t).__name__)}")
        values.append(t._value())
    return cut(list(dict.fromkeys(values)))


def graph_text(tensors) -> str:
    """Return the pending graph that computes `tensors` (a lazy tensor or a list) as text; runs nothing."""
    return format_graph(_graph_of(tensors))


def graph_dot(tensors) -> str:
    """Return the pending graph that computes `tensors` as Graphviz dot; runs nothing."""
    return format_dot(_graph_of(tensors))
