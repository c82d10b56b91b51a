"""The lazy device's core: IR, tracing, sync and execution."""
