"""The install's build hook: compiles the native library (CMakeLists.txt) into the package.

`pip install .` puts it into the wheel, `pip install -e .` into this source tree, both as
ratex/_lib/libratex_kernels.so, where ratex/core/kernels.py looks for it. The library is
optional: where cmake or a C++ compiler is missing, or the build fails, the install goes on
without it and ratex uses its Python kernels. `python setup.py build_native --inplace`
rebuilds it in this tree without reinstalling (scripts/setup.sh does, every run).
"""
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Command, Distribution, setup
from setuptools.command.build import build

ROOT = Path(__file__).resolve().parent
LIBRARY = Path("ratex", "_lib", "libratex_kernels.so")  # as CMakeLists.txt installs it


class BuildNative(Command):
    """Configure, build and install CMakeLists.txt's library under the package tree."""

    description = "build the native kernel library into ratex/_lib/"
    user_options = [("inplace", "i", "install it into this source tree")]
    boolean_options = ["inplace"]

    def initialize_options(self):
        self.inplace = False
        self.editable_mode = False  # set by setuptools for `pip install -e`
        self.build_lib = None
        self.build_temp = None

    def finalize_options(self):
        self.set_undefined_options("build", ("build_lib", "build_lib"), ("build_temp", "build_temp"))
        self.inplace = self.inplace or self.editable_mode

    def _prefix(self):
        return ROOT if self.inplace else Path(self.build_lib)

    def run(self):
        # An in-place build keeps its CMake tree, so the next one recompiles only what changed. A
        # wheel's starts afresh: it compiles everything anyway (each isolated build has a torch of
        # its own), and a kept cache would ignore the CXX or CXXFLAGS given to this one.
        if self.inplace:
            work = ROOT / "build" / "native"
        else:
            work = Path(self.build_temp) / "native"
            shutil.rmtree(work, ignore_errors=True)
        target = self._prefix() / LIBRARY
        reason = self._build(work)
        if reason is not None:
            # A library left from an earlier build would be loaded as if it were this one; a
            # failed tree would keep the compiler and flags that failed for the next try.
            target.unlink(missing_ok=True)
            shutil.rmtree(work, ignore_errors=True)
            print(f"note: native kernels not built ({reason}); ratex will use its Python kernels", file=sys.stderr)

    def _build(self, work):
        """None once the library is installed under the prefix, else why it is not."""
        if shutil.which("cmake") is None:
            return "cmake is missing"
        configure = ["cmake", "-S", str(ROOT), "-B", str(work), f"-DPython_EXECUTABLE={sys.executable}"]
        if shutil.which("ninja") and not (work / "CMakeCache.txt").exists():
            configure += ["-G", "Ninja"]  # a tree keeps the generator it was configured with
        steps = {
            "configuring (is a C++ compiler installed?)": configure,
            "compiling": ["cmake", "--build", str(work)],
            "installing": ["cmake", "--install", str(work), "--prefix", str(self._prefix())],
        }
        for what, step in steps.items():
            if subprocess.run(step).returncode != 0:
                return f"CMake failed {what}: see its output above"
        return None

    def get_outputs(self):
        """The installed library's path (none where it failed to build)."""
        target = self._prefix() / LIBRARY
        return [str(target)] if target.exists() else []


class Build(build):
    """setuptools' build, then the native library."""

    sub_commands = build.sub_commands + [("build_native", None)]


class BinaryDistribution(Distribution):
    """A wheel that carries a shared library: tagged for its platform and installed to platlib."""

    def has_ext_modules(self):
        """True: the native library is a binary extension in all but name."""
        return True


setup(distclass=BinaryDistribution, cmdclass={"build": Build, "build_native": BuildNative})
