"""`torch.compile(model_or_step, backend="ratex")`: capture once with dynamo, compile with TVM.

Dynamo captures Python frames into fx graphs (breaking where it cannot trace:
`loss.backward()`, unsupported Python), AOTAutograd splits each into a forward
and a backward graph of ATen ops (or one inference graph, e.g. an optimizer
step), and each graph is lowered by the same `tvm_lowering` rule table and
pass pipeline as the lazy device's, through the same compile caches, for the
target that its tensors' device picks (CPU: LLVM, CUDA: CUDA). Calls run the
compiled programs on the caller's tensors (DLPack, no copies); ops without a
lowering rule run in eager PyTorch between them (counted as `aten::<op>`).

    model = ratex.compile(model)                      # or torch.compile(model, backend="ratex")
    step = torch.compile(train_step, backend="ratex")  # forward, backward and the optimizer update

The backend is registered with dynamo as "ratex" when `torch._dynamo` is
imported (at once if it already is), so `import ratex` does not pay for
importing dynamo.
"""
import importlib.abc
import importlib.machinery
import sys

import torch

_REGISTRY = "torch._dynamo.backends.registry"


def backend(gm, example_inputs, **options):
    """Return the compiled callable of a dynamo graph (what `backend="ratex"` names)."""
    from .aot import backend as aot_backend  # noqa: PLC0415

    return aot_backend(gm, example_inputs, **options)


def compile(model=None, **kwargs):  # noqa: A001  (ratex.compile mirrors torch.compile)
    """Return `torch.compile(model, backend="ratex", **kwargs)`."""
    if "backend" in kwargs:
        raise TypeError(f"ratex.compile always uses the 'ratex' backend; got backend={kwargs['backend']!r}")
    return torch.compile(model, backend=backend, **kwargs)


def _register(registry):
    if "ratex" not in registry._COMPILER_FNS:
        registry.register_backend(compiler_fn=backend, name="ratex")


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers the backend right after dynamo's backend registry module is first imported."""

    def find_spec(self, name, path, target=None):
        if name != _REGISTRY:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _register(module)

        spec.loader.exec_module = exec_module
        sys.meta_path.remove(self)
        return spec


if _REGISTRY in sys.modules:
    _register(sys.modules[_REGISTRY])
elif not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterOnImport())
