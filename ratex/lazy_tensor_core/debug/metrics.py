"""Counters and timers of the lazy device, as in torch._lazy.metrics and torch_xla's debug.metrics."""
from ...core.metrics import (  # noqa: F401
    counter_names,
    counter_value,
    metric_data,
    metric_names,
    metrics_report,
    reset,
    short_metrics_report,
)
