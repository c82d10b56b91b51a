"""Compatibility namespace matching Ratex's `ratex.lazy_tensor_core`."""
