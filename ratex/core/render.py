"""A graph cut as text or Graphviz dot: for `ratex.debug` and the RATEX_SAVE_IR dumps."""
import torch

from .graph import Graph
from .ir import fill


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
