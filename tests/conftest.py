import pytest
import torch

import ratex  # noqa: F401  (registers the lazy device)
from ratex.lazy_tensor_core.debug import metrics


@pytest.fixture
def dev():
    """The lazy device, with counters reset."""
    metrics.reset()
    return torch.device("lazy", 0)
