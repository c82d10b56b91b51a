"""Utilities of the lazy device, as in torch_xla.utils."""
