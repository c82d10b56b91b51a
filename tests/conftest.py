import os

# No persistent compile cache shared between tests or with ~/.cache: tests that
# need one give their subprocesses a RATEX_CACHE_DIR of their own.
os.environ["RATEX_CACHE_DIR"] = ""
# The suite compiles hundreds of graphs in one process: the warning that names RATEX_DEBUG after
# many compiles would land in whichever test happens to make the tenth (tests/test_recompile.py
# checks it on its own).
os.environ["RATEX_WARN_COMPILES"] = "0"

import pytest  # noqa: E402
import torch  # noqa: E402

import ratex  # noqa: E402,F401  (registers the lazy device)
from ratex.lazy_tensor_core.debug import metrics  # noqa: E402


@pytest.fixture
def dev():
    """The lazy device, with counters reset."""
    metrics.reset()
    return torch.device("lazy", 0)


@pytest.fixture(params=["native", "python"])
def wrap_programs(request, monkeypatch):
    """wrap_programs(wrap): from then on every program run calls wrap(fn, inputs) instead of
    fn(*inputs), fn being the compiled program. The test runs once on each worker that runs
    programs: the native runner's thread (csrc/runner.cc; skipped where it is off or not
    built), which calls `wrap` back through tvm-ffi, and the Python executor thread."""
    import tvm_ffi

    from ratex import config
    from ratex.core import executor

    if request.param == "native" and (
        not config.NATIVE_RUNNER or tvm_ffi.get_global_func("ratex.runner.prepare", allow_missing=True) is None
    ):
        pytest.skip("the native runner is off (RATEX_NATIVE_RUNNER) or not built (scripts/setup.sh builds it)")

    def install(wrap):
        if request.param == "native":
            def launcher(self):
                return self.native_launcher(tvm_ffi.convert(lambda *xs: wrap(self.fn, xs)))
        else:
            run = executor.Program.run

            def launcher(self):
                return None

            monkeypatch.setattr(executor.Program, "run", lambda self, inputs: wrap(lambda *xs: run(self, list(xs)), inputs))
        monkeypatch.setattr(executor.Program, "launcher", launcher)

    return install


@pytest.fixture
def seeded():
    """torch.manual_seed(0) first: the rule tests draw the same random inputs on every run."""
    torch.manual_seed(0)


@pytest.fixture
def tvm_kernels(monkeypatch):
    """Exercise the TVM rules themselves, not the kernel library that CPU uses by default."""
    from ratex import config
    from ratex.core import sync

    monkeypatch.setattr(config, "KERNELS", "TVM")
    sync.reset_cache()  # programs compiled with the library must not be reused here, nor these elsewhere
    yield
    sync.reset_cache()
