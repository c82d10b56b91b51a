"""ratex: PyTorch's `lazy` device, compiled by Apache TVM.

`import ratex` is all it takes: tensors moved to 'lazy' record ATen ops, and
`ratex.lazy_tensor_core.core.lazy_model.mark_step()` compiles and runs them.

The core's layers (ratex/core/__init__.py) import only downwards; this module
assembles them: loading the tracer and the sync layer installs them into
LazyTensor, which then records ops and computes values on reads. What the
import changes in the process is listed in ratex/process.py.
"""
from . import config  # noqa: F401  (parses every RATEX_* environment variable; a bad value raises here)
from . import process

process.apply()  # before TVM's thread pool starts: it reads the variables this sets
from .core import sync, tracing  # noqa: E402,F401  (install the tracer and the sync layer into LazyTensor)
from .core.tensor import LazyTensor, is_lazy  # noqa: E402
from .lazy_tensor_core.core import lazy_model  # noqa: E402
from .lazy_tensor_core.debug import metrics  # noqa: E402
from . import jit  # noqa: E402  (ratex.jit.script)
from . import debug, profiler  # noqa: E402,F401  (ratex.profiler.Profiler, RATEX_PROFILE, ratex.debug.graph_text)
from . import amp, data  # noqa: E402,F401  (ratex.amp.autocast, ratex.data.DeviceLoader)
from .dynamo import compile  # noqa: E402  (torch.compile(backend="ratex"); registers the backend)
from . import distributed  # noqa: E402,F401  (lm.all_reduce & co; torch.distributed's calls on lazy tensors)
from .version import __version__  # noqa: E402

process.drive_torch_lazy(lazy_model, metrics)

__all__ = ["LazyTensor", "amp", "compile", "data", "is_lazy", "jit", "lazy_model", "metrics", "__version__"]
