"""Elementwise arithmetic rules where TVM's differ from PyTorch."""
