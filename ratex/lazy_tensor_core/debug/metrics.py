"""Counters and timers of the lazy device, as in torch._lazy.metrics."""
from ...core.metrics import (  # noqa: F401
    counter_names,
    counter_value,
    metric_data,
    metric_names,
    metrics_report,
    reset,
)
