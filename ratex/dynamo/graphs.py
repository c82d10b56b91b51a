"""Rewrites of an AOTAutograd graph before it is partitioned and lowered.

AOTAutograd hands over functional fx graphs of ATen OpOverloads whose nodes
carry fake-tensor metas (`meta["val"]`). Before `tvm_lowering` sees one:

- `specialize` fixes symbolic shapes (`dynamic=True`) to the sizes of one call;
- `unroll_foreach` writes each `_foreach_*` op (a foreach optimizer's arithmetic
  over all parameters at once) as one op per tensor, which the rules lower and
  fusion regroups;
- `take_mutations` removes the `copy_` nodes into graph inputs that AOTAutograd
  keeps in the graph (`keep_inference_input_mutations`: the optimizer's updates
  of parameters and state) and returns them as (input, new value) pairs, so the
  new values become program outputs that are written back, in place where
  donation allows;
- `draw_seeds` turns training-mode dropout into the lazy path's seeded keep mask,
  the seed being an extra graph input drawn from torch's generator at each call;
- `graph_key` is the structural key of the result (the compile cache's key).
"""
import operator

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from . import adapter

aten = torch.ops.aten


def is_symbolic(gm: fx.GraphModule) -> bool:
    """Return whether some placeholder is a symbolic int or a tensor of symbolic shape."""
    for n in gm.graph.find_nodes(op="placeholder"):
        val = n.meta.get("val")
        if isinstance(val, torch.SymInt):
            return True
        if isinstance(val, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in val.shape):
            return True
    return False


def specialize(gm: fx.GraphModule, args: list) -> fx.Graph:
    """Return `gm`'s graph retraced for the concrete ints and tensor shapes of `args`."""
    return make_fx(lambda *xs: gm.forward(*xs), tracing_mode="fake", _allow_non_fake_inputs=True)(*args).graph


def placeholders(graph: fx.Graph) -> list:
    """Return the graph's placeholder nodes in order."""
    return list(graph.find_nodes(op="placeholder"))


def output_values(graph: fx.Graph) -> list:
    """Return the graph's outputs (nodes, None or constants) as a list."""
    out = graph.output_node().args[0]
    return list(out) if isinstance(out, (tuple, list)) else [out]


def take_mutations(graph: fx.Graph) -> list:
    """Remove `copy_(input, value)` nodes; return (input position, value) pairs in graph order.

    Every one goes, whatever its shapes and dtypes: Relax is functional, and a `copy_`
    left to a lowering rule would compute a value that nothing writes back. The write-back
    (`torch.Tensor.copy_`) broadcasts and casts as the op would.
    """
    position = {n: k for k, n in enumerate(placeholders(graph))}
    pairs = []
    for n in list(graph.nodes):
        if n.op == "call_function" and n.target is aten.copy_.default and n.args[0] in position and not n.users:
            pairs.append((position[n.args[0]], n.args[1]))
            graph.erase_node(n)
    return pairs


# _foreach_<name>.<overload> -> the overload of <name> that computes one element, by the kind of
# the foreach overload's arguments (a `default` one maps to <name>.default); absent: the foreach
# op stays whole (and runs eagerly).
_ELEMENT = {
    "List": {"add": "Tensor", "sub": "Tensor", "mul": "Tensor", "div": "Tensor", "maximum": "default",
             "minimum": "default", "clamp_min": "Tensor", "clamp_max": "Tensor", "pow": "Tensor_Tensor",
             "lerp": "Tensor", "copy": "default"},
    "Scalar": {"add": "Tensor", "sub": "Tensor", "mul": "Tensor", "div": "Tensor", "clamp_min": "default",
               "clamp_max": "default", "pow": "Tensor_Scalar", "addcmul": "default", "addcdiv": "default",
               "lerp": "Scalar"},
    "Tensor": {"add": "Tensor", "sub": "Tensor", "mul": "Tensor", "div": "Tensor"},
    "ScalarAndTensor": {"pow": "Scalar"},
}
_ELEMENT["ScalarList"] = dict(_ELEMENT["Scalar"])


def unroll_foreach(graph: fx.Graph) -> int:
    """Replace each functional `_foreach_*` op by one op per element; return how many were unrolled.

    Arguments that are lists (tensors, or scalars of a ScalarList overload) are indexed per
    element, the rest are passed to every element's op; each new node's meta is the foreach
    op's meta for that element.
    """
    count = 0
    for n in list(graph.nodes):
        op = n.target
        if n.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
            continue
        name, _, overload = op.__name__.partition(".")
        if not name.startswith("_foreach_") or op._schema.is_mutable:
            continue
        base = name[len("_foreach_"):]
        vals = n.meta.get("val")
        if not isinstance(vals, (list, tuple)):
            continue
        if op is aten._foreach_norm.Scalar:  # (tensors, ord, dtype) -> linalg_vector_norm(x, ord, dim, keepdim, dtype=)
            single, norm = aten.linalg_vector_norm.default, dict(zip(("self", "ord", "dtype"), n.args), **n.kwargs)
            norm.pop("self")
            calls = [((x, norm.get("ord", 2)), {"dtype": norm.get("dtype")}) for x in n.args[0]]
        else:
            element = "default" if overload == "default" else _ELEMENT.get(overload, {}).get(base)
            single = getattr(getattr(aten, base, None), element, None) if element else None
            if single is None:
                continue
            calls = [_element_args(single, n, i) for i in range(len(vals))]
            if None in calls:
                continue
        with graph.inserting_before(n):
            items = [_call(graph, single, args, kwargs, val) for (args, kwargs), val in zip(calls, vals)]
        for user in list(n.users):
            if user.target is not operator.getitem:
                break
            user.replace_all_uses_with(items[user.args[1]])
            graph.erase_node(user)
        if not n.users:
            graph.erase_node(n)
            count += 1
    return count


def _element_args(single, node, i):
    """(args, kwargs) of `single` for element i of foreach `node`: list arguments indexed, the rest
    as they are; positional arguments past `single`'s positional ones go to its keyword-only ones
    in order (`_foreach_addcmul.Scalar`'s value is positional, `addcmul`'s keyword-only). None
    where they do not fit."""
    pick = lambda a: a[i] if isinstance(a, (list, tuple)) else a  # noqa: E731
    params = single._schema.arguments
    positional = [a.name for a in params if not a.kwarg_only]
    keyword = [a.name for a in params if a.kwarg_only]
    args = [pick(a) for a in node.args]
    kwargs = {k: pick(v) for k, v in node.kwargs.items()}
    extra = args[len(positional):]
    if len(extra) > len(keyword) or any(k not in positional + keyword for k in kwargs):
        return None
    kwargs.update(zip(keyword, extra))
    return tuple(args[:len(positional)]), kwargs


def draw_seeds(graph: fx.Graph) -> int:
    """Rewrite training-mode `native_dropout` into `ratex::dropout_keep` on a new int64 seed
    input (appended after the placeholders); return how many seed inputs were added.

    The mask is the one the lazy device draws for the same seed: `uniform >= p`, and the
    output is x * mask / (1 - p), as ratex/core/tracing/random.py records it. With p = 0 (or not
    training) it keeps everything: the output is a copy of x, the mask all true, as torch's.
    """
    drops = [n for n in graph.nodes if n.op == "call_function" and n.target is aten.native_dropout.default]
    count = 0
    last = placeholders(graph)[-1] if placeholders(graph) else None
    for n in drops:
        x, p = n.args[0], float(n.args[1])
        train = n.args[2] if len(n.args) > 2 else n.kwargs.get("train")
        xval = x.meta.get("val")
        if not isinstance(xval, torch.Tensor) or not xval.dtype.is_floating_point or (train and not 0 <= p < 1):
            continue
        size, dt = list(xval.shape), xval.dtype
        with graph.inserting_before(n):
            if not train or p == 0:
                out = _call(graph, aten.clone.default, (x,), {}, torch.empty(size, dtype=dt, device="meta"))
                keep = _call(graph, aten.full.default, (size, True), {"dtype": torch.bool, "device": xval.device},
                             torch.empty(size, dtype=torch.bool, device="meta"))
            else:
                with graph.inserting_after(last) if last is not None else graph.inserting_before(None):
                    seed = graph.placeholder(f"ratex_seed{count}")
                seed.meta["val"] = torch.empty((), dtype=torch.int64, device="meta")
                seed.meta["ratex_seed"] = True
                last = seed
                count += 1
                prob = _call(graph, aten.full.default, ([], p), {"dtype": torch.float32, "device": xval.device},
                             torch.empty((), dtype=torch.float32, device="meta"))
                keep = _call(graph, adapter.DROPOUT_KEEP, (seed, size, prob), {},
                             torch.empty(size, dtype=torch.bool, device="meta"))
                masked = _call(graph, aten.mul.Tensor, (x, keep), {}, torch.empty(size, dtype=dt, device="meta"))
                out = _call(graph, aten.mul.Tensor, (masked, 1.0 / (1.0 - p)), {},
                            torch.empty(size, dtype=dt, device="meta"))
        for user in list(n.users):
            if user.target is operator.getitem:
                user.replace_all_uses_with(out if user.args[1] == 0 else keep)
                graph.erase_node(user)
        if not n.users:
            graph.erase_node(n)
    return count


def _call(graph, target, args, kwargs, val):
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = val
    return node


def device_kind(graph: fx.Graph) -> tuple:
    """(kind, CUDA arch, device index): ('CPU', '', 0), or ('GPU', 'sm_XY', i) where the graph's
    tensors are on CUDA device i (0-dim CPU tensors may be mixed in, as in eager CUDA)."""
    devices = set()
    for n in graph.nodes:
        if n.meta.get("ratex_seed"):
            continue
        for val in _tensors(n.meta.get("val")):
            devices.add(val.device)
    kinds = {d.type for d in devices} - {"meta"}
    if kinds <= {"cpu"}:
        return "CPU", "", 0
    cuda = {d.index or 0 for d in devices if d.type == "cuda"}
    if kinds <= {"cpu", "cuda"} and len(cuda) == 1:
        index = cuda.pop()
        major, minor = torch.cuda.get_device_capability(index)
        return "GPU", f"sm_{major}{minor}", index
    raise RuntimeError(
        f"torch.compile(backend='ratex') compiles graphs of CPU tensors or of one CUDA device's; this graph has tensors on "
        f"{sorted(str(d) for d in devices)}. Move the model and its inputs to 'cpu' or 'cuda' (the 'lazy' device is ratex's "
        "other front end, which needs no torch.compile)"
    )


def _tensors(val):
    if isinstance(val, torch.Tensor):
        yield val
    elif isinstance(val, (tuple, list)):
        for v in val:
            yield from _tensors(v)


def graph_key(graph: fx.Graph) -> tuple:
    """Return a structural key of `graph`: each node's op and non-node arguments, how the nodes
    connect, the placeholders' shapes and dtypes, and the outputs."""
    index, entries, metas = {}, [], []

    def freeze(a):
        if isinstance(a, fx.Node):
            return ("%", index[a])
        if isinstance(a, (list, tuple)):
            return tuple(freeze(x) for x in a)
        if isinstance(a, dict):
            return tuple((k, freeze(v)) for k, v in sorted(a.items()))
        if isinstance(a, torch.device):
            return torch.device(a.type)  # the index is the caller's business, not the program's
        return atom(a)

    for n in graph.nodes:
        if n.op == "placeholder":
            index[n] = len(index)
            metas.append(_meta(n.meta.get("val")))
        elif n.op == "call_function":
            index[n] = len(index)
            entries.append((n.target, freeze(n.args), freeze(n.kwargs), _meta(n.meta.get("val"))))
        elif n.op == "output":
            entries.append(("output", freeze(n.args[0])))
    return tuple(metas), tuple(entries)


def atom(a):
    """A key's stand-in for a constant argument: floats and bools tagged, since 1 == 1.0 == True
    and -0.0 == 0.0 in Python (each pair hashes alike) but not in a program; a float by its repr,
    which also makes NaN equal to itself."""
    t = type(a)
    if t is float:
        return ("float", repr(a))
    if t is bool:
        return ("bool", a)
    return a


def _meta(val):
    if isinstance(val, torch.Tensor):
        return (tuple(int(s) for s in val.shape), val.dtype)
    if isinstance(val, (tuple, list)):
        return tuple(_meta(v) for v in val)
    return type(val).__name__
