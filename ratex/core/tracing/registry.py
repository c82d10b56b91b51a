"""Routing: which code traces an ATen call, chosen once per op, and the one way to register it.

`register(*keys, tier=...)` files a function in one of three tiers:
  HANDLER        fn(func, args, kwargs) owns the op outright (sync points, copies, fills,
                 multi-output views, in-place arithmetic, random ops);
  DECOMPOSITION  fn(*args, **kwargs) re-expresses the op in simpler ATen ops, or returns
                 NotImplemented to leave the call to the op's path;
  PATH           fn(func, args, kwargs) traces every op of a kind with no handler:
                 "foreach", "view", "mutating" (in-place and out=), "functional".
`dispatch` looks the route up: the handler, else the path of foreach ops, else the
decomposition falling through to the path of the op's kind.
"""
import torch

HANDLER, DECOMPOSITION, PATH = "handler", "decomposition", "path"
KINDS = ("foreach", "view", "mutating", "functional")

HANDLERS = {}  # OpOverload -> fn(func, args, kwargs)
DECOMPS = {}  # OpOverload -> fn(*args, **kwargs): result, or NotImplemented
PATHS = {}  # kind -> fn(func, args, kwargs)
_TIERS = {HANDLER: HANDLERS, DECOMPOSITION: DECOMPS, PATH: PATHS}


def register(*keys, tier):
    """Return a decorator that files its function under `keys` (ops, or kinds for PATH) in `tier`."""
    table = _TIERS.get(tier)
    if table is None:
        raise ValueError(f"unknown tier {tier!r}; expected one of {sorted(_TIERS)}")

    def file(fn):
        for key in keys:
            _check(key, tier)
        for key in keys:
            table[key] = fn
        return fn

    return file


def _check(key, tier):
    if tier == PATH:
        if key not in KINDS or key in PATHS:
            raise ValueError(f"path kind {key!r} is unknown or registered twice; the kinds are {KINDS}")
        return
    if not isinstance(key, torch._ops.OpOverload):
        raise TypeError(f"register takes OpOverloads (e.g. aten.add.Tensor), got {key!r}")
    if key in HANDLERS or key in DECOMPS:
        raise ValueError(f"{key} is registered twice: an op has one handler or one decomposition")
    if id(key) in _routes:
        raise ValueError(f"{key} is registered after it was first traced: its route is fixed already")


def dispatch(func, args, kwargs):
    """Trace (or run) one ATen call whose arguments include lazy tensors; return its result."""
    route = _routes.get(id(func))
    if route is None:
        route = _routes[id(func)] = _route(func)
        _routed.append(func)
    return route(func, args, kwargs)


# By id: OpOverload.__hash__ is Python code, slow for a per-op lookup. _routed keeps the ops alive.
_routes, _routed = {}, []


def _route(func):
    """Choose, once per OpOverload, which registered code traces it (see the module doc)."""
    handler = HANDLERS.get(func)
    if handler is not None:
        return handler
    if func.__name__.startswith("_foreach_"):
        return PATHS["foreach"]
    decomp = DECOMPS.get(func)
    kind = "view" if func.is_view else "mutating" if func._schema.is_mutable else "functional"
    fallthrough = PATHS[kind]
    if decomp is None:
        return fallthrough

    def decomposed(func, args, kwargs):
        out = decomp(*args, **kwargs)
        return fallthrough(func, args, kwargs) if out is NotImplemented else out

    return decomposed
