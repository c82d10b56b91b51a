"""The import structure of ratex/core: layers that import only downwards, no cycles, no
imports hidden in functions, every module importable on its own; tvm_lowering never
imports ratex.

    python tests/test_layering.py     # prints the layers and what each module imports
"""
import ast
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORE = ROOT / "ratex" / "core"

# Bottom to top: a module imports modules of its own layer or of those below, never above
# (ratex/core/__init__.py describes them). `tracing` is the package and all its modules.
LAYERS = (
    ("ir", ("metrics", "progress", "tvm_log", "ir", "shape", "graph", "render")),
    ("runtime", ("device", "kernels", "bounds", "launch", "executor")),
    ("tensor", ("storage", "chain", "tensor")),
    ("tracing", ("tracing",)),
    ("sync", ("explain", "sync")),
)
_LAYER_OF = {name: k for k, (_, names) in enumerate(LAYERS) for name in names}


def core_modules() -> list:
    """Names of ratex/core's modules relative to ratex.core ('ir', 'tracing', 'tracing.record')."""
    names = []
    for path in sorted(CORE.rglob("*.py")):
        parts = path.relative_to(CORE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            names.append(".".join(parts))
    return names


def _path(name: str) -> pathlib.Path:
    base = CORE.joinpath(*name.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _absolute(name: str, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom in ratex.core.<name> names (before its imported names)."""
    package = ("ratex.core." + name).split(".")
    if not _path(name).name == "__init__.py":
        package = package[:-1]
    if node.level:
        package = package[: len(package) - node.level + 1]
        return ".".join(package + ([node.module] if node.module else []))
    return node.module


def _targets(name: str, node) -> list:
    """Absolute names of the modules an import statement loads."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = _absolute(name, node)
    return [base] + [f"{base}.{a.name}" for a in node.names]


def _core_name(absolute: str, known: set):
    if absolute.startswith("ratex.core."):
        rel = absolute[len("ratex.core."):]
        return rel if rel in known else None
    return None


def top_level_imports(name: str, known: set) -> set:
    """The ratex/core modules that module `name` imports at its top level (a package's
    submodule loads the package too, seen from outside it)."""
    tree = ast.parse(_path(name).read_text())
    out = set()
    for node in tree.body:
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        for target in _targets(name, node):
            mod = _core_name(target, known)
            if mod is None or mod == name or name.startswith(mod + "."):  # itself, or its own package
                continue
            out.add(mod)
            package = mod.split(".")[0]
            if package not in (mod, name) and package in known and not name.startswith(package + "."):
                out.add(package)
    return out


def import_graph() -> dict:
    """{module: the ratex/core modules it imports at its top level}."""
    known = set(core_modules())
    return {name: top_level_imports(name, known) for name in core_modules()}


def _layer(name: str) -> int:
    return _LAYER_OF[name.split(".")[0]]


def layering_text(graph: dict) -> str:
    """The layers from the top down, each module with what it imports."""
    lines = []
    for k in reversed(range(len(LAYERS))):
        lines.append(f"{LAYERS[k][0]}:")
        for name in sorted(n for n in graph if _layer(n) == k):
            lines.append(f"  {name:22} -> {', '.join(sorted(graph[name])) or '-'}")
    return "\n".join(lines)


def test_every_core_module_has_a_layer():
    missing = [n for n in core_modules() if n.split(".")[0] not in _LAYER_OF]
    assert not missing, f"put these modules of ratex/core into a layer of LAYERS: {missing}"


def test_core_imports_point_down_and_have_no_cycle():
    graph = import_graph()
    print("\n" + layering_text(graph))
    upward = [(a, b) for a, deps in graph.items() for b in deps if _layer(b) > _layer(a)]
    assert not upward, f"imports from a lower layer to a higher one: {upward}"
    order, done, stack = [], set(), []

    def visit(name):
        if name in done:
            return
        assert name not in stack, "import cycle: " + " -> ".join(stack[stack.index(name):] + [name])
        stack.append(name)
        for dep in sorted(graph[name]):
            visit(dep)
        stack.pop()
        done.add(name)
        order.append(name)

    for name in sorted(graph):
        visit(name)
    assert len(order) == len(graph)


def test_no_imports_inside_functions_in_core():
    """A function-level import of ratex hides a dependency (and, usually, a cycle)."""
    found = []
    for name in core_modules():
        tree = ast.parse(_path(name).read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("ratex")):
                    found.append(f"{name}:{node.lineno}")
                elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "ratex" for a in node.names):
                    found.append(f"{name}:{node.lineno}")
    assert not found, f"imports of ratex inside functions: {found}"


def test_tvm_lowering_never_imports_ratex():
    found = []
    for path in sorted((ROOT / "tvm_lowering").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            if any(n.split(".")[0] == "ratex" for n in names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"tvm_lowering imports ratex: {found}"


# Each child is forked from a process that has loaded only torch and tvm, so it starts with
# no module of ratex or tvm_lowering loaded. ratex/__init__.py imports every layer, so
# importing ratex.core.X would normally load all of ratex first and hide a module that works
# only because something else was loaded before it: the child registers a bare `ratex`
# package instead, and only X's own imports run.
_CHILD = r"""
import importlib, importlib.machinery, os, sys, traceback, types
import torch, tvm, tvm_ffi

root, names = sys.argv[1], sys.argv[2:]
failed = []
for name in names:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            if name.startswith("ratex."):
                bare = types.ModuleType("ratex")
                bare.__path__ = [os.path.join(root, "ratex")]
                bare.__file__ = os.path.join(root, "ratex", "__init__.py")
                # a package's spec, so importlib.resources finds its data (the native library)
                bare.__spec__ = importlib.machinery.ModuleSpec("ratex", None, is_package=True)
                bare.__spec__.submodule_search_locations = bare.__path__
                sys.modules["ratex"] = bare
            importlib.import_module(name)
        except BaseException:
            print(f"---- import {name} alone failed:", file=sys.stderr)
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if os.waitpid(pid, 0)[1]:
        failed.append(name)
print("FAILED", " ".join(failed))
"""


def test_each_module_imports_alone():
    names = ["tvm_lowering", "ratex"] + [f"ratex.core.{n}" for n in core_modules()]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(ROOT), *names], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    failed = proc.stdout.strip().splitlines()[-1].split()[1:]
    assert not failed, f"these modules fail to import on their own: {failed}\n{proc.stderr[-4000:]}"


if __name__ == "__main__":
    print(layering_text(import_graph()))
