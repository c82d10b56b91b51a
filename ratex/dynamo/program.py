"""Compiled graphs: what AOTAutograd calls at every step.

`CompiledGraph` stands for one AOTAutograd graph (a forward, a backward, or an
inference graph such as an `optimizer.step()`). On its first call (for a graph
with symbolic shapes: the first call with each set of sizes) it prepares the
graph (graphs.py), splits it (partition.py), compiles each lowerable region
through the compile caches, and builds a driver; every later call runs the
driver: the regions' programs on the caller's tensors, exchanged with TVM by
DLPack, the eager ops between them, and the write-back of mutated inputs.

A call is host time that eager PyTorch's step does not have, so the usual graph, one
region and no eager op, skips the fx driver (`direct_call`), and a CPU region's later calls
go through one call of the native library (csrc/host.cc: arguments checked, index checks
read, updates found in their inputs' buffers) instead of Python per output.
"""
import operator
import time

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

import tvm_lowering
from tvm_lowering import codegen
from tvm_lowering.ops.bounds import SITE
from . import adapter, graphs, partition

_perf = time.perf_counter
_record = adapter.record
_listeners = adapter.listeners  # the profiler's list, changed in place as listeners come and go
_deferred = adapter.deferred  # CUDA index checks not yet read, changed in place


class Region:
    """A compiled lowerable region: called with its inputs' tensors, returns its outputs' tensors.

    TVM's FFI takes torch tensors and returns torch tensors, sharing memory by DLPack in C.
    Inputs must be compact: a non-contiguous one is copied first. Outputs that share a buffer
    where torch's ops would not have are copied (see `_find_shared`). A program that indexes
    with tensors returns its index checks after the `n_outs` outputs: an index out of range
    raises IndexError here, naming its op among `nodes` (the region's, by position).
    """

    def __init__(self, fn, empty: tuple, constant: tuple, may_share, name: str, host=((), (), None), n_outs=None,
                 nodes=()):
        self.fn = fn
        self.n_outs, self.nodes = n_outs, nodes
        self.empty = empty  # input positions without elements (TVM may not take their DLPack strides as compact)
        # (inputs to move to the device, outputs to move back, the device): CPU scalars in a CUDA
        # graph (Adam's step count, the dropout seeds), which a CUDA program cannot read in place
        self.to_device, self.to_host, self.device = host
        self.constant = constant  # outputs computed from no input: the program returns the same buffer every call
        self.may_share = may_share  # may_share(a, j): whether output j may share a buffer with a (input i or ("out", k))
        self.copy = None  # output positions to copy at every call (known after the first)
        self.convert = False  # whether the FFI hands back tensors that are not torch's
        # (input, output) pairs whose output the caller only writes back into that input: an
        # output the program wrote into the input's own buffer comes back as None (see `run`)
        self.in_place = ()
        self.native = False  # whether calls may go through the native library (a CPU program)
        self.fast = None  # the native library's call of this region, once the first call is done
        self.__name__ = name

    def __call__(self, *xs):
        return self.run(xs)

    def run(self, xs) -> list:
        """The outputs of a call on the tensors `xs`; None for an output of an `in_place` pair
        that the program wrote into its input's buffer (only through the native library, whose
        `ratex.host.region` checks the arguments, reads the index checks and compares the
        buffers in one call: csrc/host.cc)."""
        fast = self.fast
        if fast is not None:
            start = _perf()
            got = fast(*xs)[:]
            end = _perf()
            status = got[0]
            if status != 2:  # 2: an argument that is not compact or has no elements: nothing ran
                _record("ExecuteTime", start, end)
                if _listeners:
                    adapter.tell("Sync", start, end)
                del got[0]
                if status == 1:
                    adapter.check_indices(got.pop(), self.nodes)
                for j in self.copy:
                    got[j] = got[j].clone()
                return got
        return self._call(xs)

    def _call(self, xs) -> list:
        if _deferred:
            adapter.read_checks()
        xs = [x if x.is_contiguous() else x.contiguous() for x in xs]
        if self.to_device:  # queued behind the running programs, not waited for (blocking would wait for them)
            xs = [x.to(self.device, non_blocking=True) if k in self.to_device else x for k, x in enumerate(xs)]
        if self.empty:
            xs = [_empty(x) if k in self.empty else x for k, x in enumerate(xs)]
        start = _perf()
        outs = self.fn(*xs)[:]
        end = _perf()
        _record("ExecuteTime", start, end)
        if _listeners:
            adapter.tell("Sync", start, end)
        if self.copy is None:
            self.convert = any(type(o) is not torch.Tensor for o in outs)
        if self.convert:
            outs = [o if type(o) is torch.Tensor else torch.from_dlpack(o) for o in outs]
        if self.n_outs is not None and len(outs) > self.n_outs:
            rows = outs.pop()
            if rows.is_cuda:
                adapter.check_indices_later(rows, self.nodes)
            else:
                adapter.check_indices(rows, self.nodes)
        if self.copy is None:
            self.copy = self._find_shared(xs, outs)
            self._arm()
        for j in self.copy:
            outs[j] = outs[j].clone()
        for j in self.to_host:
            outs[j] = outs[j].cpu()
        return outs

    def _arm(self):
        """Make later calls go through the native library where it is loaded: a CPU program
        whose inputs all have elements (`run` falls back to `_call` for one that comes with
        another layout)."""
        prepare = _native_region()
        if prepare is None or not self.native or self.empty or self.to_device or self.to_host or self.convert:
            return
        self.fast = prepare(self.fn, -1 if self.n_outs is None else self.n_outs,
                            [k for pair in self.in_place for k in pair])

    def _find_shared(self, xs: list, outs: list) -> tuple:
        """Output positions sharing a buffer with an input or an earlier output where torch's ops
        make a new tensor (TVM's rules make `clone` an identity, reshapes views), and outputs
        that are folded constants. A later in-place write to one of the two (an optimizer step,
        `zero_grad(set_to_none=False)`) must not reach the other. The program's structure decides
        which outputs share, so the first call finds them for every later one."""
        owner = {}
        for i, x in enumerate(xs):
            if isinstance(x, torch.Tensor) and x.numel():
                owner.setdefault(x.data_ptr(), i)
        shared = set(self.constant)
        for j, o in enumerate(outs):
            if not o.numel():
                continue
            who = owner.get(o.data_ptr())
            if who is None:
                owner[o.data_ptr()] = ("out", j)
            elif not self.may_share(who, j):
                shared.add(j)
        return tuple(sorted(shared))


def _native_region():
    """`ratex.host.region` of the native library (csrc/host.cc), or None where it is not loaded."""
    import tvm  # noqa: PLC0415

    return tvm.get_global_func("ratex.host.region", allow_missing=True)


def _empty(x):
    import tvm  # noqa: PLC0415

    dev = tvm.cpu() if x.device.type == "cpu" else tvm.cuda(x.device.index or 0)
    return tvm.runtime.empty(tuple(x.shape), str(x.dtype).replace("torch.", ""), dev)


class _Retry(Exception):
    """A node was refused while compiling a region: partition the graph again."""


class CompiledGraph:
    """The callable AOTAutograd gets for one graph (boxed: called with the list of its inputs)."""

    def __init__(self, gm: fx.GraphModule, role: str):
        # An instance attribute: AOTAutograd wraps the backward's callable with functools.wraps,
        # which carries the instance's __dict__ over to the wrapper, not its class attributes.
        self._boxed_call = True
        self.gm = gm
        self.role = role  # 'forward', 'backward' or 'inference'
        self.symbolic = graphs.is_symbolic(gm)
        self.run = None  # the driver of a graph with fixed shapes
        self.runs = {}  # sizes -> driver, for a graph with symbolic shapes

    def __call__(self, args):
        run = self.run
        if run is not None:
            return run(args)
        if not self.symbolic:
            run = self.run = self._build(args)
            return run(args)
        sizes = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)
        run = self.runs.get(sizes)
        if run is None:
            run = self.runs[sizes] = self._build(args)
        return run(args)

    def _build(self, args):
        start = _perf()
        try:
            return self._prepare(args)
        finally:
            if _listeners:
                adapter.tell("Sync", start, _perf())

    def _prepare(self, args):
        graph, mutations, seeds = prepare(self.gm, args if self.symbolic else None)
        kind, arch, index = graphs.device_kind(graph)
        gm = fx.GraphModule(self.gm, graph)  # its get_attr constants (lifted tensors) come along
        writes = [n for n in graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                  and n.target._schema.is_mutable]
        while True:
            if writes:  # the order of eager writes and the programs' reads would need care: run it all eagerly
                adapter.warn_fallback(writes[0].target.__name__, "an in-place op is left in the graph")
                parts = []
            else:
                parts = partition.regions(gm)
            lowered = {n for part in parts for n in part}
            for n in graph.nodes:
                if n.op == "call_function" and n not in lowered and isinstance(n.target, torch._ops.OpOverload):
                    adapter.warn_fallback(n.target.__name__, partition.why_not(n) or "it is not lowerable here")

            def compile_region(nodes, inputs, outputs):
                return self._region(graph, nodes, inputs, outputs, mutations, kind, arch, index)

            try:
                driver = partition.driver(graph, parts, compile_region, mutations)
                break
            except _Retry:
                continue
        direct = direct_call(driver, seeds)
        if direct is not None:
            return direct
        forward = driver.forward
        if not seeds:
            return lambda args: forward(*args)
        new_seed = adapter.new_seed
        return lambda args: forward(*args, *[new_seed() for _ in range(seeds)])

    def _region(self, graph, nodes, inputs, outputs, mutations, kind, arch, index):
        sub, back = region_graph(nodes, inputs, outputs)
        args = list(graph.find_nodes(op="placeholder"))
        inside = set(nodes)
        at_in, at_out = {a: i for i, a in enumerate(inputs)}, {o: j for j, o in enumerate(outputs)}
        pairs = []  # (region input, region output, read only here) of a mutation: written back, donated where allowed
        for pos, value in mutations:
            dst = args[pos]
            if dst in at_in and value in at_out:
                pairs.append((at_in[dst], at_out[value], all(u in inside for u in dst.users)))
        # Donation writes into the input's buffer while the program runs: only where nothing
        # outside the region reads the input.
        donate = tuple(sorted((i, j) for i, j, alone in pairs if alone)) if adapter.param_aliasing() else ()
        key = ("dynamo", kind, arch, donate, graphs.graph_key(sub))
        lib = self._program(sub, key, kind, arch, donate, back, len(nodes))
        dev = _device(kind, index)
        fn = codegen.virtual_machine(lib, dev)["main"]
        host = ((), (), None)
        if kind == "GPU":
            on_host = lambda n: n.meta.get("ratex_seed") or n.meta["val"].device.type == "cpu"  # noqa: E731
            host = (tuple(k for k, a in enumerate(inputs) if on_host(a)),
                    tuple(j for j, o in enumerate(outputs) if _device_of(o) == "cpu"), torch.device("cuda", index))
        region = Region(fn, _empty_inputs(inputs), _constant_outputs(sub), _sharing(inputs, outputs, pairs),
                        f"ratex_{self.role}", host, len(outputs), nodes)
        region.native = kind == "CPU"
        return region

    def _program(self, sub, key, kind, arch, donate, back, ops):
        cache = adapter.memory_cache()
        lib = cache.get(key)
        if lib is not None:
            adapter.counter_inc("CachedCompile")
            return lib
        lib = adapter.load(key, kind, arch)
        if lib is None:
            try:
                mod = adapter.lower(sub, kind)
            except tvm_lowering.LoweringError as err:
                node = back.get(err.node)
                if node is None:
                    raise
                partition.refuse(node)
                adapter.warn_fallback(node.target.__name__, str(err))
                raise _Retry() from err
            if adapter.saving_ir():
                adapter.save_ir(f"-- {self.role} graph ({ops} ops)\n{sub}\n-- Relax\n{mod.script()}")
            try:
                lib, _ = adapter.build(mod, kind, arch, donate, f"a {self.role} graph of {ops} ops", key, ops)
            except Exception as err:  # noqa: BLE001 - a TVM pass failed on some node: find it
                self._isolate(sub, back, kind, arch, err)
                raise _Retry() from err
            adapter.counter_inc("UncachedCompile")
        cache.put(key, lib)
        return lib

    def _isolate(self, sub, back, kind, arch, err):
        """Compile the region's ops one at a time and refuse those that fail (all, if none fails alone)."""
        failed = []
        calls = [n for n in sub.nodes if n.op == "call_function" and n.target is not operator.getitem]
        for n in calls:
            one, env = fx.Graph(), {}
            for a in n.all_input_nodes:
                env[a] = one.placeholder(f"in{len(env)}")
                env[a].meta["val"] = a.meta["val"]
            call = one.node_copy(n, lambda a: env[a])
            one.output((call,))
            try:
                adapter.build(adapter.lower(one, kind), kind, arch, (), "one op", None, 1)
            except Exception:  # noqa: BLE001 - this op is one that fails
                failed.append(n)
        for n in failed or calls:
            partition.refuse(back[n])
            adapter.warn_fallback(back[n].target.__name__, f"compiling failed ({type(err).__name__}: {str(err)[:300]})")


def direct_call(driver: fx.GraphModule, seeds: int):
    """The driver of a graph that is one region (the usual case) as a plain function of the
    call's argument list, or None for any other graph (which runs as `driver.forward`).

    `driver`'s nodes are then placeholders, one region call on some of them, the items of
    its result, and at most one write-back; the function calls the region on its arguments
    picked by position, writes back the mutated inputs and returns the outputs picked by
    position, with no fx module or per-node Python in between. The region's outputs that are
    only written back get `Region.in_place`: the native library leaves out those it finds in
    their input's own buffer (donated), for which the write-back has nothing to do.
    """
    graph = driver.graph
    args = list(graph.find_nodes(op="placeholder"))
    position = {a: k for k, a in enumerate(args)}
    calls = [n for n in graph.nodes if n.op == "call_function"]
    regions = [n for n in calls if isinstance(n.target, Region)]
    if len(regions) != 1 or any(n.op not in ("placeholder", "call_function", "output") for n in graph.nodes):
        return None
    call = regions[0]
    region = call.target
    if call.kwargs or any(a not in position for a in call.args):
        return None
    item, back = {}, None
    for n in calls:
        if n is call:
            continue
        if n.target is operator.getitem and n.args[0] is call and type(n.args[1]) is int:
            item[n] = n.args[1]
        elif n.target is partition.write_back and back is None:
            back = n
        else:
            return None

    def ref(a):
        """(0, argument position), (1, region output) or (2, a constant)."""
        if isinstance(a, fx.Node):
            return (0, position[a]) if a in position else (1, item[a]) if a in item else None
        return (2, a)

    outs = [ref(a) for a in graph.output_node().args[0]]
    writes = []
    if back is not None:
        dsts, srcs = back.args
        writes = [(position.get(d), ref(v)) for d, v in zip(dsts, srcs)]
        if any(k is None for k, _ in writes):
            return None
    if None in outs or any(r is None for _, r in writes):
        return None
    read = [ref(a)[1] for a in call.args]
    returned = {r[1] for r in outs if r[0] == 1}
    written = [r[1] for _, r in writes if r[0] == 1]
    region.in_place = tuple((read.index(k), j) for k, (kind, j) in writes
                            if kind == 1 and k in read and j not in returned and written.count(j) == 1)
    return _direct(region, tuple(read), tuple(outs), tuple(writes), seeds)


def _direct(region, read: tuple, outs: tuple, writes: tuple, seeds: int):
    run = region.run
    new_seed = adapter.new_seed
    write_back = partition.write_back

    def call(args):
        if seeds:
            args = [*args, *[new_seed() for _ in range(seeds)]]
        got = run([args[k] for k in read])
        if writes:
            dsts, srcs = [], []
            for k, (kind, v) in writes:
                src = args[v] if kind == 0 else got[v] if kind == 1 else v
                if src is not None:  # None: the program wrote it into the input's own buffer
                    dsts.append(args[k])
                    srcs.append(src)
            if dsts:
                write_back(dsts, srcs)
        return [args[v] if kind == 0 else got[v] if kind == 1 else v for kind, v in outs]

    return call


def prepare(gm: fx.GraphModule, sizes_of=None) -> tuple:
    """Return (graph, mutations, seeds): `gm`'s graph ready to partition (for graphs with symbolic
    shapes: specialized to the sizes of the call arguments `sizes_of`), its input mutations as
    (input position, new value) pairs, and how many seed inputs it takes after its own."""
    graph = graphs.specialize(gm, sizes_of) if sizes_of is not None else _copy(gm.graph)
    graphs.unroll_foreach(graph)  # first: the copy_ nodes read the getitems it replaces
    mutations = graphs.take_mutations(graph)
    seeds = graphs.draw_seeds(graph)
    return graph, mutations, seeds


def region_graph(nodes: list, inputs: list, outputs: list) -> tuple:
    """Return (graph, back): a region as an fx graph of its own, with a placeholder per input
    and a tuple output, and the map from its nodes back to the original ones. A node's position
    in `nodes` is its meta[SITE], by which the program's index checks name it."""
    sub, back, env = fx.Graph(), {}, {}
    for i, a in enumerate(inputs):
        p = env[a] = sub.placeholder(f"in{i}")
        p.meta["val"] = a.meta["val"]
    for k, n in enumerate(nodes):
        env[n] = sub.node_copy(n, lambda a: env[a])
        env[n].meta[SITE] = k
        back[env[n]] = n
    sub.output(tuple(env[o] for o in outputs))
    return sub, back


def _copy(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    return new


def _device(kind: str, index: int):
    import tvm  # noqa: PLC0415

    return tvm.cpu() if kind == "CPU" else tvm.cuda(index)


def _device_of(node) -> str:
    val = node.meta.get("val")
    return val.device.type if isinstance(val, torch.Tensor) else ""


def _empty_inputs(inputs) -> tuple:
    return tuple(k for k, a in enumerate(inputs) if a.meta["val"].numel() == 0)


def _constant_outputs(sub: fx.Graph) -> tuple:
    fed = set()
    for n in sub.nodes:
        if n.op == "placeholder" or any(a in fed for a in n.all_input_nodes):
            fed.add(n)
    outs = graphs.output_values(sub)
    return tuple(j for j, o in enumerate(outs) if o not in fed)


def _storage(val):
    try:
        return StorageWeakRef(val.untyped_storage())
    except Exception:  # noqa: BLE001 - no storage to speak of
        return None


def _sharing(inputs, outputs, pairs):
    """may_share(a, j) for a region: output j may share the buffer of input a (or of output
    ("out", k)) where the input is the one its value is written back to, or where torch's
    own tensors share storage too (a view returned beside its base)."""
    ins = [_storage(a.meta["val"]) for a in inputs]
    outs = [_storage(o.meta["val"]) for o in outputs]
    written = {(i, j) for i, j, _ in pairs}

    def may_share(a, j):
        if type(a) is int:
            return (a, j) in written or (ins[a] is not None and ins[a] == outs[j])
        return outs[a[1]] is not None and outs[a[1]] == outs[j]

    return may_share
