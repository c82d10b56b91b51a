"""Everything that knows Relax: ATen->Relax rules, pass pipelines, compile cache.

Data flows one way: `ratex` hands over a `torch.fx.Graph` of ATen OpOverloads
whose placeholders carry shape/dtype metadata (never data); this package turns
it into a Relax IRModule (`import_graph`), compiles it (`build`) and caches the
result (`CompileCache`).
"""
from .importer import LoweringError, has_rule, import_graph
from .pipeline import Target, build, resolve_target
from .cache import CompileCache

__all__ = [
    "LoweringError",
    "has_rule",
    "import_graph",
    "Target",
    "build",
    "resolve_target",
    "CompileCache",
]
