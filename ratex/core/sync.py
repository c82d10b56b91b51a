"""Sync points: compute pending values, through the compile cache, and keep the results.

Programs are launched asynchronously (see launch.py); this module decides what
to compile or run eagerly and hands compiled programs over. Importing it installs
`execute` as what reading a pending lazy tensor calls (tensor.install).
"""
import warnings

import tvm_lowering
from .. import config, process
from . import explain, launch, metrics, storage, tensor
from .launch import ExecutionError, Pending, resolve  # noqa: F401  (the sync API)
from .executor import CACHE, cache_key, compile_graph, load_program
from .graph import cut, remember, replay
from .ir import Node, op_name
from .storage import pending_storages  # noqa: F401  (the sync API)
from .tracing import eager
from .tracing.eager import is_unlowerable, mark_unlowerable, unlowerable

_depth = 0  # execute() nests (eager fallbacks); only the outermost call is a "Sync" span


def execute(values: list, written=()):
    """Compute every value in `values` (pairs (node, index)) and keep the results on the nodes.

    `written`: the storages whose new values these are. Where steps donate
    buffers (ENABLE_PARAM_ALIASING, read here and nowhere else in a step), a
    storage's old buffer may receive its new value (see `donations`).
    """
    global _depth
    aliasing = config.PARAM_ALIASING
    if _depth:
        return _execute(values, written, aliasing)
    launch.raise_failures()
    _depth += 1
    try:
        with metrics.span("Sync"):
            if written:
                return _execute(values, written, aliasing)
            return _read(values, aliasing)
    finally:
        _depth -= 1


def _read(values: list, aliasing: bool):
    """Compute `values`, read before mark_step, together with every live pending tensor that
    they are computed from, and keep both.

    Those tensors are computed anyway, by this program, and mark_step would compute them again:
    kept, the next read starts from them. Dropped, every read would compute again whatever it
    shares with earlier reads, and its graph would grow with the reads since mark_step. LBFGS
    does both many times a step: it writes parameters and reads a loss from them (its closure),
    and derives tensors, reads a scalar from them and goes on from the tensors (its flat
    gradient, the gradient differences of its history, the direction it reads dot products of)."""
    live = storage.pending_storages()
    roots = [v for v in values if v[0].results[v[1]] is None]
    if live and roots:
        graph = replay(roots)  # a loop reads the same values step after step: no walk for them
        if graph is None:
            graph = cut(roots)
            remember(graph)
        inside = frozenset(graph.nodes)
        live = [st for st in live if st.value[0] in inside]
        if live:
            _execute(values + [st.value for st in live], (), aliasing)
            for st in live:
                st.rebind()
            return
    _execute(values, (), aliasing)


def donations(graph, written) -> tuple:
    """(leaf, root) index pairs of `graph` where the root is the new value of a storage in `written`
    and the leaf its old value.

    Each old value has one owner: clones copy (tracing/fills.py) and programs give
    every output its own buffer (Program.run), so no other live tensor reads the
    leaf's buffer once the tensor it belonged to has moved on.
    """
    leaf_at = graph.leaf_pos  # (node, index) -> position: nodes hash by identity
    root_at = {value: k for k, value in enumerate(graph.roots)}
    shared = _shared_leaves(graph.leaves)
    pairs, taken = [], set()
    for st in written:
        old = st.prev
        leaf = leaf_at.get(old) if old is not None else None
        root = root_at.get(st.value)
        if leaf is not None and root is not None and leaf not in taken and leaf not in shared:
            taken.add(leaf)
            pairs.append((leaf, root))
    return tuple(sorted(pairs))


def _shared_leaves(leaves) -> set:
    """Positions of leaves whose buffer another leaf holds too.

    That happens where a view still caches an op node while its storage moved on
    to a leaf made from it: one holds a Pending, the other its result. Reading all
    data first and the Pendings' results after makes this race-free (Job.run
    fills the Pending before the node).
    """
    datas = [node.results[idx] for node, idx in leaves]
    inner = [d.data for d in datas if type(d) is Pending and d.data is not None]
    if not inner and len(set(map(id, datas))) == len(datas):  # the usual case, checked at C speed
        return set()
    keys = [(id(d), id(d.data)) if type(d) is Pending and d.data is not None else (id(d),) for d in datas]
    count = {}
    for ks in keys:
        for k in ks:
            count[k] = count.get(k, 0) + 1
    if len(count) == sum(map(len, keys)):  # the usual case: every buffer held once
        return set()
    return {pos for pos, ks in enumerate(keys) if any(count[k] > 1 for k in ks)}


def _execute(values: list, written, aliasing: bool):
    while True:
        roots = list(dict.fromkeys(v for v in values if v[0].results[v[1]] is None))
        if not roots:
            return
        graph = replay(roots)
        if graph is None:
            graph = cut(roots)
            remember(graph)
        donate = donations(graph, written) if aliasing and written else ()
        key = cache_key(graph, donate, aliasing)
        program = CACHE.get(key)
        if program is None:
            launch.drain()  # no compiling or loading while a program runs: TVM's codegen isn't safe next to it
        if program is None and (program := load_program(graph, key, donate, aliasing)) is not None:
            CACHE.put(key, program)  # from the persistent cache (RATEX_CACHE_DIR)
            process.heap_grew()
            explain.compiled(graph, "loaded")
        elif program is None:
            stuck = [n for n in graph.nodes
                     if (unlowerable and is_unlowerable(n)) or not tvm_lowering.has_rule(op_name(n.op))]
            if stuck:  # e.g. a view op without a rule: compute it eagerly, then cut again
                for node in stuck:
                    run_eagerly(node)
                continue
            try:
                program = compile_graph(graph, key, donate, aliasing)
            except tvm_lowering.LoweringError as err:
                metrics.counter_inc("FailedCompile")
                node = err.node.meta.get("ratex_node")
                if node is None:
                    raise
                mark_unlowerable(node)
                _warn_once(node, err)
                run_eagerly(node)
                continue  # the failed node is data now; cut again
            except Exception as err:  # noqa: BLE001 - a TVM pass failed on some node
                metrics.counter_inc("FailedCompile")
                if len(graph.nodes) > 1:
                    _bisect(graph.nodes)
                    continue
                node = graph.nodes[0]
                mark_unlowerable(node)
                _warn_once(node, f"compiling failed ({type(err).__name__}: {str(err)[:300]})")
                run_eagerly(node)
                continue
            metrics.counter_inc("UncachedCompile")
            CACHE.put(key, program)
            process.heap_grew()
            explain.compiled(graph)
        else:
            metrics.counter_inc("CachedCompile")
        inputs = [node.results[idx] for node, idx in graph.leaves]
        if program.empty is None:
            program.empty = any(0 in node.metas[idx].shape for node, idx in graph.leaves)
        if program.label is None:  # for error messages; naming it hashes the whole key again
            program.label = f"graph {_label(graph)} ({len(graph.nodes)} ops)"
        job = launch.Job(program, inputs, roots, program.label, graph.nodes)
        if donate:
            job.forget_rollback([graph.leaves[i] for i, _ in donate])
        for (node, idx), pending in zip(roots, job.pendings):
            if len(node.results) == 1:  # Node.set_result, written out for the usual case
                node.results[0] = pending
                node.inputs = ()
            else:
                node.set_result(idx, pending)
        launch.launch(job)
        return


def _bisect(nodes: list):
    """Compute `nodes` (a graph's nodes, in order), whose program failed to compile, as two
    programs: the first half, then the second. A half that fails too is split again, down to
    the one node that fails alone and runs eagerly (`_execute`), so finding it costs about two
    compiles per halving, not one per node. Each half's inputs are computed before it: nodes
    are in order, so the first half holds the inputs of every node it holds; return None."""
    half = len(nodes) // 2
    for part in (nodes[:half], nodes[half:]):
        execute([(node, i) for node in part for i, m in enumerate(node.metas) if m is not None])


def _label(graph) -> str:
    ops = sorted({op_name(n.op) for n in graph.nodes})
    return f"{hash(graph.key) & 0xFFFFFFFF:08x} [{', '.join(ops[:8])}{', ...' if len(ops) > 8 else ''}]"


_warned = set()


def _warn_once(node, err):
    name = op_name(node.op)
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"ratex: {err}; running {name} on CPU PyTorch instead (correct, but slower)", stacklevel=3)


def run_eagerly(node: Node):
    """Compute one op node on CPU PyTorch, its inputs first; return None."""
    execute(list(node.inputs))
    eager.run_node(node)


_step_closures = []


def add_step_closure(fn, args=()):
    """Run fn(*args) once, after the next mark_step's execution is done."""
    _step_closures.append((fn, tuple(args)))


def mark_step():
    """Compute every live pending tensor in one program and make the results their data."""
    metrics.counter_inc("MarkStep")
    with metrics.span("MarkStep"):
        storages = storage.take_pending()
        with launch.rollback_point([(st, st.prev) for st in storages]):
            execute([st.value for st in storages], storages)
        for st in storages:
            st.rebind()
    process.settle_heap()
    if _step_closures:
        wait_device_ops()
        closures = _step_closures[:]
        _step_closures.clear()
        for fn, args in closures:
            fn(*args)


# Called by wait_device_ops after the lazy programs: each waits for the work of another front end
# and raises what it found (ratex.dynamo: the index checks of CUDA programs not yet read).
waiters = []


def wait_device_ops():
    """Block until all launched programs have run; raise if one of them failed."""
    launch.drain()
    launch.raise_failures()
    for wait in waiters:
        wait()


def reset_cache():
    """Forget every compiled program in memory (tests use this to count compiles)."""
    CACHE.clear()


tensor.install(execute=execute)
