"""Environment configuration, validated once at import so bad values fail early."""
import os

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _choice(name: str, default: str, valid: tuple) -> str:
    raw = os.environ.get(name, default)
    value = raw.strip().upper()
    if value not in valid:
        raise ValueError(f"{name}={raw!r} is not valid; use one of: {', '.join(valid)}")
    return value


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not valid; use true or false")


DEVICE = _choice("RATEX_DEVICE", "CPU", ("CPU", "GPU"))
PARAM_ALIASING = _flag("ENABLE_PARAM_ALIASING", False)
PROFILE = _flag("RATEX_PROFILE", False)
SAVE_IR = os.environ.get("RATEX_SAVE_IR") or None
