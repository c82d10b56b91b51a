"""Look at pending lazy graphs without running them.

    y = model(x)
    print(ratex.debug.graph_text([y]))        # one line per op
    open("g.dot", "w").write(ratex.debug.graph_dot([y]))   # dot -Tsvg g.dot > g.svg

Both cut the graph that a sync would compute for the given tensors (the same
`cut` mark_step uses) and only describe it: nothing is compiled or executed.
Values already computed appear as inputs.

    for r in ratex.debug.explain():           # why each graph after the first compiled
        print(r.cause, r.sync, r.details)       # RATEX_DEBUG=1 prints the same as it happens
"""
import torch

from .core import explain as _explain
from .core.graph import Graph, cut
from .core.render import format_dot, format_graph
from .core.tensor import LazyTensor

__all__ = ["graph_text", "graph_dot", "format_graph", "explain", "Recompile"]
Recompile = _explain.Recompile


def _graph_of(tensors) -> Graph:
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


def explain() -> list:
    """Return a `Recompile` for each graph the process compiled (or loaded from the persistent
    cache) after its first: the sync point, the graph's hash, and how it differs from the closest
    graph compiled before it (`cause`: "input shapes", "constant", "live tensors", "ops" or
    "same graph"; `details`: lines naming the inputs, argument or op)."""
    return _explain.reports()
