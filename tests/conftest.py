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
import tvm  # noqa: E402

import ratex  # noqa: E402,F401  (registers the lazy device)
from ratex import config as ratex_config  # noqa: E402
from ratex.core import device  # noqa: E402
from ratex.lazy_tensor_core.debug import metrics  # noqa: E402

# The suite runs on the device RATEX_DEVICE names: `dev` is the lazy device, whose programs are
# compiled for that target. Tests about the CPU target alone carry `cpu_only(why)`; those that run
# programs on a GPU whatever RATEX_DEVICE says carry `gpu`.
ON_CPU = ratex_config.DEVICE == "CPU"
HAS_GPU = tvm.cuda(0).exist


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_only(why): about the CPU target alone; skipped under another RATEX_DEVICE")
    config.addinivalue_line("markers", "gpu: runs programs on a CUDA GPU; skipped where TVM sees none")
    if not ON_CPU:
        try:  # a machine that can't run the target stops here, once, with the backend's own error
            device.backend()
        except RuntimeError as err:
            raise pytest.UsageError(str(err)) from err
        # The tests compare with CPU float32; cuDNN's convolutions would round through TF32.
        torch.backends.cudnn.allow_tf32 = False


def pytest_collection_modifyitems(config, items):
    for item in items:
        cpu_only = item.get_closest_marker("cpu_only")
        if cpu_only is not None and not ON_CPU:
            why = cpu_only.args[0] if cpu_only.args else "about the CPU target"
            item.add_marker(pytest.mark.skip(reason=f"CPU only ({why}); RATEX_DEVICE={ratex_config.DEVICE}"))
        if item.get_closest_marker("gpu") is not None and not HAS_GPU:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU visible to TVM"))


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

    if request.param == "native" and not device.backend_class().native_runner:
        pytest.skip(f"the native runner runs CPU programs only (RATEX_DEVICE={config.DEVICE})")
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
