"""Everything that knows Relax: ATen->Relax rules, targets, pass pipelines, compile cache.

Data flows one way: `ratex` hands over a `torch.fx.Graph` of ATen OpOverloads
whose placeholders carry shape/dtype metadata (never data); this package turns
it into a Relax IRModule (`import_graph`), compiles it for a registered target
(`resolve_target`, `build`) and caches the result in memory and on disk
(`CompileCache`). Settings arrive as arguments (`Options`); nothing here reads
the environment.
"""
from .importer import LoweringError, has_rule, import_graph
from .targets import Options, Target, resolve_target
from .pipeline import build
from .cache import CompileCache

__all__ = [
    "LoweringError",
    "has_rule",
    "import_graph",
    "Options",
    "Target",
    "build",
    "resolve_target",
    "CompileCache",
]
