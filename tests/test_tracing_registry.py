"""The tracer's one registration mechanism (ratex/core/tracing/registry.py) refuses what would
route an op two ways or never: a second registration, an unknown tier or kind, a late one."""
import pytest
import torch

import ratex  # noqa: F401  (loads the tracer)
from ratex.core.tracing import registry
from ratex.core.tracing.registry import DECOMPOSITION, HANDLER, PATH, register

aten = torch.ops.aten


def test_every_kind_of_op_has_a_path():
    assert set(registry.PATHS) == set(registry.KINDS)


def test_an_op_is_registered_once():
    assert aten.copy_.default in registry.HANDLERS
    with pytest.raises(ValueError, match="registered twice"):
        register(aten.copy_.default, tier=DECOMPOSITION)(lambda *a, **k: NotImplemented)
    assert aten.addcmul.default in registry.DECOMPS
    with pytest.raises(ValueError, match="registered twice"):
        register(aten.addcmul.default, tier=HANDLER)(lambda func, args, kwargs: None)


def test_unknown_tier_kind_or_key_is_refused():
    with pytest.raises(ValueError, match="unknown tier"):
        register(aten.sin.default, tier="rule")
    with pytest.raises(ValueError, match="path kind"):
        register("elementwise", tier=PATH)(lambda func, args, kwargs: None)
    with pytest.raises(TypeError, match="OpOverloads"):
        register("sin", tier=HANDLER)(lambda func, args, kwargs: None)


def test_a_registration_after_the_op_was_traced_is_refused():
    x = torch.ones(2).to("lazy")
    torch.cos(x)  # routes aten.cos.default
    assert aten.cos.default not in registry.HANDLERS
    with pytest.raises(ValueError, match="after it was first traced"):
        register(aten.cos.default, tier=HANDLER)(lambda func, args, kwargs: None)
    assert aten.cos.default not in registry.HANDLERS
