"""ratex: PyTorch's `lazy` device, compiled by Apache TVM.

`import ratex` is all it takes: tensors moved to 'lazy' record ATen ops, and
`ratex.lazy_tensor_core.core.lazy_model.mark_step()` compiles and runs them.
"""
from . import config  # noqa: F401  (validates RATEX_* environment variables at import)
from .core import tensor as _tensor  # noqa: F401  (registers the lazy device)
from .core.tensor import LazyTensor, is_lazy
from .lazy_tensor_core.core import lazy_model
from .lazy_tensor_core.debug import metrics
from . import jit  # noqa: E402  (ratex.jit.script)
from . import debug, profiler  # noqa: E402,F401  (ratex.profiler.Profiler, RATEX_PROFILE, ratex.debug.graph_text)
from .dynamo import compile  # noqa: E402  (torch.compile(backend="ratex"); registers the backend)

__version__ = "0.1.0"
__all__ = ["LazyTensor", "compile", "is_lazy", "jit", "lazy_model", "metrics", "__version__"]
