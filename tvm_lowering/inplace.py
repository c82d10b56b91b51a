"""Buffer donation (ENABLE_PARAM_ALIASING): write a step's updates into the buffers they replace.

The caller says which outputs of `main` are the new values of which inputs
("output j overwrites input i": a parameter, its gradient, an optimizer state).
After fusion and scheduling, when every op is a `call_tir` to a PrimFunc,
`donate` turns the call that produces output j into a `call_tir_inplace` that
writes into input i's buffer, so memory planning allocates nothing for it and
the step's peak memory drops by the size of what it overwrites.

Donation is an optimization; a call is rewritten only where that provably
computes the same values:

- the Relax side: output j comes straight from a `call_tir` of the same shape
  and dtype as input i, with input i as one of its arguments, and neither
  input i nor anything that may share its buffer (reshapes, tuples, packed
  calls other than the kernel library's, whose results are new tensors) is read
  after that call or returned;
- the PrimFunc side (`_writes_in_place`): exactly one block writes the output,
  pointwise at its own data-parallel iterators, reading the input there only at
  that same point; every other read of the input happens in loop nests that
  finish before that block's nest starts, and nothing after it touches either.

The runtime side (ratex/core) makes sure nothing else reads a donated buffer:
each program output gets a buffer of its own, clones copy, and a failed step
cannot roll a donated buffer back (the tensors that owned one keep the error).
Outputs of multi-output kernels (a tuple from one fused call_tir) are not
donated yet.
"""
import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx

_DATA_PAR = 0  # IterVar kind of a spatial (data-parallel) block iterator


def donate(donations, realized: list):
    """Return a module pass that applies `donations` ((input, output) index pairs) to `main`.

    The pairs it could apply are appended to `realized`.
    """

    @tvm.transform.module_pass(opt_level=0, name="RatexDonateBuffers")
    def _pass(mod, _ctx):
        new, done = _donate(mod, dict((o, i) for i, o in donations))
        realized.extend(done)
        return new

    return _pass


def _bindings(func):
    return [b for block in func.body.blocks for b in block.bindings]


def _alias_sets(func, mod) -> dict:
    """For each var of `func`, the indices of the parameters whose buffer it may share."""
    params = {p: frozenset((k,)) for k, p in enumerate(func.params)}
    sets = dict(params)

    def of(expr):
        return frozenset().union(*(sets.get(v, frozenset()) for v in relax.analysis.free_vars(expr)))

    for b in _bindings(func):
        value = b.value
        if isinstance(value, relax.Call) and value.op.same_as(tvm.ir.Op.get("relax.call_tir")):
            callee = mod[value.args[0]]
            # Legalized reshapes become views of their input (RewriteDataflowReshape); the rest allocate.
            sets[b.var] = of(value.args[1]) if relax.analysis.has_reshape_pattern(callee) else frozenset()
        elif _is_library_call(value):  # ratex.lib.* kernels return buffers of their own
            sets[b.var] = frozenset()
        else:  # vars, tuples, packed calls, other ops: may return (part of) what they are given
            sets[b.var] = of(value)
    return sets


_LIBRARY_CALLS = ("call_pure_packed", "call_dps_packed")


def _is_library_call(value) -> bool:
    """A call of the kernel library (ratex/core/kernels.py), whose results are always new tensors."""
    if not isinstance(value, relax.Call) or not any(value.op.same_as(tvm.ir.Op.get(f"relax.{op}")) for op in _LIBRARY_CALLS):
        return False
    fn = value.args[0]
    return isinstance(fn, relax.ExternFunc) and str(fn.global_symbol).startswith("ratex.lib.")


def _donate(mod, wanted: dict):
    """Rewrite `mod`'s main for the donations in `wanted` (output -> input); return (mod, pairs done)."""
    gv = mod.get_global_var("main")
    func = mod[gv]
    if not isinstance(func.body, relax.SeqExpr) or not isinstance(func.body.body, relax.Var):
        return mod, []
    bindings = _bindings(func)
    where = {b.var: k for k, b in enumerate(bindings)}
    result = bindings[where[func.body.body]].value if func.body.body in where else None
    if not isinstance(result, relax.Tuple):
        return mod, []
    sets = _alias_sets(func, mod)
    uses = [relax.analysis.free_vars(b.value) for b in bindings]
    returned = frozenset().union(*(sets.get(f, frozenset()) for f in result.fields))
    call_tir = tvm.ir.Op.get("relax.call_tir")
    builder = relax.BlockBuilder(mod)  # gives new PrimFuncs GlobalVars that carry their type
    rewrites, done = {}, []
    for j, i in sorted(wanted.items()):
        out = result.fields[j] if j < len(result.fields) else None
        k = where.get(out)
        if k is None or k in rewrites or i in returned:
            continue
        call = bindings[k].value
        if not (isinstance(call, relax.Call) and call.op.same_as(call_tir) and len(call.args) == 2):
            continue
        args = list(call.args[1].fields)
        param = func.params[i]
        if not isinstance(out.ty, relax.TensorType) or not tvm_ffi.structural_equal(out.ty, param.ty):
            continue
        positions = [a for a, arg in enumerate(args) if i in sets.get(arg, frozenset())]
        if len(positions) != 1 or not args[positions[0]].same_as(param):
            continue  # absent, passed twice, or passed through an alias
        # Anything sharing the input's buffer must be dead once the call has run.
        if any(i in sets.get(v, frozenset()) for later in uses[k + 1:] for v in later):
            continue
        prim = mod[call.args[0]]
        if not isinstance(prim, tirx.PrimFunc) or len(prim.params) != len(args) + 1:
            continue
        source, target = prim.params[positions[0]], prim.params[len(args)]
        if not _writes_in_place(prim, source, target):
            continue
        inplace = prim.specialize({target: source})  # the output buffer becomes the input's
        new_gv = builder.add_func(inplace, f"{call.args[0].name_hint}_inplace")
        rewrites[k] = relax.op.call_tir_inplace(new_gv, call.args[1], [positions[0]], out.ty)
        done.append((i, j))
    if not rewrites:
        return mod, []
    blocks = []
    for block in func.body.blocks:
        new = [relax.VarBinding(b.var, rewrites[where[b.var]]) if where[b.var] in rewrites else b
               for b in block.bindings]
        blocks.append(relax.DataflowBlock(new) if isinstance(block, relax.DataflowBlock) else relax.BindingBlock(new))
    body = relax.SeqExpr(blocks, func.body.body)
    builder.update_func(gv, relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span))
    return builder.get(), done


def _sblocks(stmt) -> list:
    found = []
    tvm_ffi.structural_walk(stmt, (s_tir.SBlock, found.append), order="pre")
    return found


def _is_point(region) -> bool:
    return all(isinstance(r.extent, tirx.IntImm) and r.extent.value == 1 and isinstance(r.min, tirx.Var)
               for r in region.region)


def _writes_in_place(prim, source, target) -> bool:
    """Whether writing `target` into `source`'s buffer computes what the PrimFunc computes."""
    body = prim.body
    if isinstance(body, s_tir.SBlockRealize):
        body = body.block.body  # the root block
    store, store_nest, read_nests = None, None, set()
    for n, nest in enumerate(tirx.stmt_list(body)):
        for block in _sblocks(nest):
            if not any(r.source.same_as(b) for r in list(block.reads) + list(block.writes) for b in (source, target)):
                continue
            if store is not None:
                return False  # touched after (or beside) the in-place write
            if any(w.source.same_as(target) for w in block.writes):
                store, store_nest = block, n
            elif any(r.source.same_as(target) for r in block.reads) or any(w.source.same_as(source) for w in block.writes):
                return False
            else:
                read_nests.add(n)  # an earlier read of the input: safe if its nest ends before the store's
    if store is None or any(n >= store_nest for n in read_nests):
        return False
    if store.init is not None or store.match_buffers or _sblocks(store.body) \
            or any(int(iv.iter_type) != _DATA_PAR for iv in store.iter_vars):
        return False  # nested blocks or reduction iterators: not one point per iteration
    if len(store.writes) != 1 or any(r.source.same_as(target) for r in store.reads):
        return False  # reading the output would read the input once they are one buffer
    point = [r.min for r in store.writes[0].region]
    iters = {iv.var for iv in store.iter_vars}
    if not _is_point(store.writes[0]) or len(set(point)) != len(point) or not set(point) <= iters:
        return False  # each iteration must own one distinct element
    # Within the storing block the input may be read only at the element being written.
    return all(_is_point(r) and [x.min for x in r.region] == point for r in store.reads if r.source.same_as(source))
