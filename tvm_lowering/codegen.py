"""Machine code for a program's kernels: built on several threads, without the argument checks
that cannot fail.

TVM's LLVM code generation builds one module on one thread, and most of a cold compile is spent
there. A program's kernels are independent functions, so they are split into one module per
available core, each built (and JIT-compiled, for a program that runs in this process) on a
thread of its own; TVM releases the GIL while it generates code. The first module imports the
others, where the VM finds every kernel by name.

LLVM's command-line options (a target's `cl-opt`; the CPU target's `-enable-if-conversion=false`)
are process-wide: TVM sets them when a build starts and puts back what it found when it ends, so
two builds with options on two threads at once undo each other's. The option changes only how
LLVM vectorizes a loop with a branch in it, so the kernels without one (most) are built for the
target without its options, which touches none, on any thread; those with a branch are built as
one module with the options, one such build in the process at a time (`llvm_options`).

Every kernel is a packed function whose prologue checks each argument (count, type, ndim, dtype,
device, shape, strides, offset) and builds an error message for each check: most of a small
kernel's LLVM IR, and of the time LLVM spends on it. A ratex program calls its kernels only from
its own VM: each intermediate it passes was allocated by the VM with the kernel's shape and
dtype, and the VM checks the ndim, dtype and shape of `main`'s inputs before any kernel runs.
`trim_argument_checks` drops the checks the VM already makes or that its calls cannot fail, and
keeps those it does not make (compact strides, zero byte offset, device type) and every check
it does not know.
"""
import collections
import concurrent.futures
import contextlib
import itertools
import os
import re
import threading

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.relax import vm_build

# Messages of the prologue checks that a call from the VM cannot fail (see the module doc).
_REDUNDANT = (
    "Expected ",  # the argument count
    "args pointer is NULL",
    "Mismatched type on argument #",  # an FFI object that is not a tensor
    ".ndim on argument #",
    ".dtype on argument #",
    "data pointer is NULL on argument #",
    ".device_id",  # two arguments on different devices of the same type
    ".shape[",
)
_NOTHING = tirx.Evaluate(0)
PIPELINE = "ratex"  # the TIR pipeline: TVM's default, then trim_argument_checks


def _text(assert_stmt) -> str:
    """The start of a check's message: what it checks is named in its first three parts."""
    parts = assert_stmt.message_parts
    return "".join(str(parts[k].value) for k in range(min(3, len(parts))))


def _trim(stmt):
    """`stmt` without the redundant checks outside the kernel's body (the compute scope); None if
    nothing is left of it."""
    kind = type(stmt)
    if kind is tirx.AssertStmt:
        text = _text(stmt)
        return None if any(m in text for m in _REDUNDANT) else stmt
    if kind is tirx.SeqStmt:
        kept = [s for s in (_trim(s) for s in stmt.seq) if s is not None]
        return tirx.SeqStmt(kept) if len(kept) > 1 else (kept[0] if kept else None)
    if kind is tirx.AttrStmt and stmt.attr_key != "compute_scope":
        body = _trim(stmt.body)
        return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, body if body is not None else _NOTHING)
    if kind is tirx.IfThenElse and stmt.else_case is None:
        then = _trim(stmt.then_case)
        return None if then is None else tirx.IfThenElse(stmt.condition, then, None)
    return stmt


@tvm.transform.module_pass(opt_level=0, name="RatexTrimArgumentChecks")
def trim_argument_checks(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Drop the argument checks of packed kernels (after MakePackedAPI) that a VM's call cannot fail."""
    funcs = {}
    for gv, func in mod.functions.items():
        if isinstance(func, tirx.PrimFunc) and func.attrs is not None and int(func.attrs.get("calling_conv", 0)) == 1:
            body = _trim(func.body)
            func = func.with_body(body if body is not None else _NOTHING)
        funcs[gv] = func
    return tvm.IRModule(funcs, attrs=mod.attrs)


def _pipeline():
    passes, finalize_host, finalize_device = tvm.tirx.get_tir_pipeline("default")
    return tvm.transform.Sequential([passes, trim_argument_checks]), finalize_host, finalize_device


tvm.tirx.compilation_pipeline.register_tir_pipeline(PIPELINE, _pipeline)


def cores() -> int:
    """Return how many cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _shards(mod: tvm.IRModule, count: int) -> list:
    """Split the functions of `mod` into up to `count` modules of about equal work: the largest
    first, each to the module with the least so far (a kernel's parameters stand for its size)."""
    funcs = sorted(mod.functions.items(), key=lambda gf: (-len(gf[1].params), gf[0].name_hint))
    loads = [[0, {}] for _ in range(min(count, len(funcs)))]
    for gv, func in funcs:
        least = min(loads, key=lambda load: load[0])
        least[0] += 4 + len(func.params)
        least[1][gv] = func
    return [tvm.IRModule(funcs, attrs=mod.attrs) for _, funcs in loads]


# Every TIR construct that LLVM's code for a kernel can branch on: a kernel without any has
# straight-line loop bodies, which the target's LLVM options do not change.
_BRANCHES = re.compile(r"\bif\b|if_then_else|T\.where|assert|Assert|\bwhile\b|break|continue|call_packed")
# Held while TVM builds, JIT-compiles or exports code with LLVM command-line options.
LLVM_OPTIONS = threading.Lock()


def llvm_options(target: tvm.target.Target):
    """LLVM_OPTIONS for a target with LLVM command-line options (see the module doc), else no lock."""
    return LLVM_OPTIONS if target.kind.name == "llvm" and target.attrs.get("cl-opt") else contextlib.nullcontext()


def virtual_machine(executable, device) -> relax.VirtualMachine:
    """A VM of `executable` on `device`. Making one looks up every kernel, and a lookup in a
    JIT-compiled module of a target with LLVM options sets and resets them as a build does."""
    with LLVM_OPTIONS:
        return relax.VirtualMachine(executable, device)


def _without_options(target: tvm.target.Target) -> tvm.target.Target:
    return tvm.target.Target({k: v for k, v in target.export().items() if k != "cl-opt"})


def _branching(func: tirx.PrimFunc) -> bool:
    """Whether `func`'s code may branch (conservatively: by the words of its TIR)."""
    return _BRANCHES.search(func.script()) is not None


def _build_shards(mod: tvm.IRModule, target: tvm.target.Target, jit: bool, threads: int) -> list:
    """Build the kernels of `mod` (an llvm target's) into (shard, runtime module) pairs, a thread
    each; with `jit`, each module's machine code is made on its thread too."""
    ctx = tvm.transform.PassContext.current()  # thread-local in TVM: each worker enters it again

    def build(shard, shard_target):
        with llvm_options(shard_target), ctx:
            lib = tvm.tirx.build(shard, target=shard_target, pipeline=PIPELINE)
            if jit:
                for gv in shard.get_global_vars():
                    lib.get_function(gv.name_hint)
        return lib

    count = threads or cores()
    work = []
    if target.attrs.get("cl-opt"):
        # A branching kernel built while another build puts the CPU target's
        # -enable-if-conversion=false back can read the wrong elements (a rotary slice_scatter
        # does: targets.py), so the branching ones build with it, under LLVM_OPTIONS.
        branching = {gv: f for gv, f in mod.functions.items() if _branching(f)}
        if branching:
            work.append((tvm.IRModule(branching, attrs=mod.attrs), target))
            mod = tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv not in branching}, attrs=mod.attrs)
        target = _without_options(target)
    if mod.get_global_vars():  # the branching module first: a thread takes it while the others share the rest
        work += [(shard, target) for shard in _shards(mod, count)]
    if len(work) < 2 or count < 2:
        return [(shard, build(shard, shard_target)) for shard, shard_target in work]
    with concurrent.futures.ThreadPoolExecutor(min(count, len(work)), thread_name_prefix="ratex-codegen") as pool:
        libs = [pool.submit(build, shard, shard_target) for shard, shard_target in work]
        return [(shard, lib.result()) for (shard, _), lib in zip(work, libs)]


def build_kernels(mod: tvm.IRModule, target: tvm.target.Target, jit: bool, threads: int = 0):
    """Return the runtime module of the kernels (PrimFuncs) in `mod` for `target`, built on
    `threads` threads (0: one per core); with `jit`, its machine code made now (else when it is
    exported: hold LLVM_OPTIONS while exporting it)."""
    if target.kind.name != "llvm":
        return tvm.tirx.build(mod, target=target)
    libs = [lib for _, lib in _build_shards(mod, target, jit, threads)]
    for lib in libs[1:]:
        libs[0].import_module(lib)
    return libs[0]


class KernelCache:
    """The kernels built in this process, by content, for the programs that run here.

    Programs share kernels (a training step and the forward that ran before it; the samples
    of a module sweep): a kernel built once is found again by structure and its machine code
    reused. A program's VM finds its kernels by name in every module it imports, so a kernel
    that may be shared is named by its content (its name, then its structural hash), and a
    name is given to one kernel only, ever, in every module that holds it. Kernels of an
    exported program (the disk cache) are neither looked up nor kept: its library must hold
    them all. At most `capacity` kernels are kept, the least recently used dropped first.
    """

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._entries = collections.OrderedDict()  # name -> [kernel, key, runtime module or None]
        self._by_key = {}  # (target, pass config, structural hash) -> names
        self._issued = set()  # every name given out: none is given to a second kernel
        self._unique = itertools.count()
        self._lock = threading.Lock()

    def name(self, mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
        """`mod` (a Relax module through its pipeline) with every kernel named by its content."""
        where = (str(target), str(tvm.transform.PassContext.current().config))
        funcs, taken = {}, set()
        with self._lock:
            for gv, func in mod.functions.items():
                if isinstance(func, tirx.PrimFunc):
                    name = self._name(func.without_attr("global_symbol"), gv.name_hint, where)
                    if name in taken:  # the same kernel twice in one module: the second is a kernel of its own
                        name = self._fresh(name)
                    taken.add(name)
                    func = func.with_attr("global_symbol", name)
                funcs[gv] = func
        return relax.transform.NormalizeGlobalVar()(tvm.IRModule(funcs, attrs=mod.attrs))

    def _fresh(self, name: str) -> str:
        """`name`, or where it was given out before, `name` with a suffix that never was."""
        given = name
        while given in self._issued:
            given = f"{name}_u{next(self._unique)}"
        self._issued.add(given)
        return given

    def _name(self, func, base: str, where: tuple) -> str:
        key = (*where, tvm_ffi.structural_hash(func) & (1 << 64) - 1)
        names = self._by_key.setdefault(key, [])
        for name in names:
            if tvm_ffi.structural_equal(self._entries[name][0], func):
                self._entries.move_to_end(name)
                return name
        name = self._fresh(f"{base}_{key[-1]:016x}")
        names.append(name)
        self._entries[name] = [func, key, None]
        return name

    def split(self, mod: tvm.IRModule) -> tuple:
        """(the kernels of `mod` not built yet, the distinct modules holding the others)."""
        fresh, held = {}, {}
        with self._lock:
            for gv, func in mod.functions.items():
                entry = self._entries.get(gv.name_hint)
                if entry is None or entry[2] is None:
                    fresh[gv] = func
                else:
                    held.setdefault(id(entry[2]), entry[2])
        return tvm.IRModule(fresh, attrs=mod.attrs), list(held.values())

    def add(self, shard: tvm.IRModule, lib):
        """Remember that runtime module `lib` holds the kernels of `shard`."""
        with self._lock:
            for gv in shard.get_global_vars():
                entry = self._entries.get(gv.name_hint)
                if entry is not None:
                    entry[2] = lib
            while len(self._entries) > self.capacity:
                name, (_, key, _) = self._entries.popitem(last=False)
                self._by_key[key].remove(name)
                if not self._by_key[key]:
                    del self._by_key[key]

    def __len__(self):
        return sum(entry[2] is not None for entry in self._entries.values())

    def clear(self):
        """Forget every kernel (the names given out stay taken)."""
        with self._lock:
            self._entries.clear()
            self._by_key.clear()


KERNELS = KernelCache()


def _called(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` without the kernels no Relax function calls any more: the pipeline leaves some behind
    (a reshape that became a view of its input, a kernel whose in-place copy replaced it)."""
    called = set()
    for func in mod.functions.values():
        if not isinstance(func, tirx.PrimFunc):
            called.update(relax.analysis.all_global_vars(func))
    if all(gv in called for gv, func in mod.functions.items() if isinstance(func, tirx.PrimFunc)):
        return mod
    kept = {gv: func for gv, func in mod.functions.items() if not isinstance(func, tirx.PrimFunc) or gv in called}
    return tvm.IRModule(kept, attrs=mod.attrs, global_infos=mod.global_infos)


def link(mod: tvm.IRModule, target: tvm.target.Target, jit: bool = True, threads: int = 0):
    """Return the VM executable of `mod`, a Relax module through its pass pipeline (what
    `tvm.compile` does after the pipeline, with the kernels built by `build_kernels`). With
    `jit` (the program runs in this process) on an llvm target, kernels are shared with the
    other programs of the process (KERNELS)."""
    attrs = dict(mod.attrs) if mod.attrs else {}
    ext_libs = list(attrs.get("external_mods", []))
    params = dict(attrs.get("const_name_to_constant", {}))
    device_libs = [m for m in ext_libs if vm_build._is_device_module(m)]
    host_libs = [m for m in ext_libs if not vm_build._is_device_module(m)]
    shared = jit and target.kind.name == "llvm" and not device_libs
    mod = _called(mod)
    if shared:
        mod = KERNELS.name(mod, target)
    builder = relax.ExecBuilder()
    mod = vm_build._vmcodegen(builder, mod, "bytecode")
    tir_mod = vm_build._filter_tir(mod)
    if tir_mod is not None and not tir_mod.get_global_vars():
        tir_mod = None
    if shared:
        kernels = []
        if tir_mod is not None:
            fresh, kernels = KERNELS.split(vm_build._auto_attach_system_lib_prefix(tir_mod, target))
            if fresh.get_global_vars():
                for shard, lib in _build_shards(fresh, target, jit, threads):
                    KERNELS.add(shard, lib)
                    kernels.append(lib)
        # VMLink makes every module an import of the executable: a shared module is never
        # changed. (Without a kernel module it links in an empty C module, which the VM then
        # compiles and links with the system compiler.)
        lib, rest = (kernels[0], kernels[1:]) if kernels else (None, [])
        return vm_build.VMExecutable(vm_build._ffi_api.VMLink(builder, target, lib, rest + host_libs, params))
    lib = None
    if tir_mod is not None:
        lib = build_kernels(vm_build._auto_attach_system_lib_prefix(tir_mod, target), target, jit, threads)
    if lib is not None:
        for m in device_libs:
            lib.import_module(m)
    elif device_libs:
        raise ValueError("device modules without kernels to import them")
    return vm_build.VMExecutable(vm_build._ffi_api.VMLink(builder, target, lib, host_libs, params))
