import os

# No persistent compile cache shared between tests or with ~/.cache: tests that
# need one give their subprocesses a RATEX_CACHE_DIR of their own.
os.environ["RATEX_CACHE_DIR"] = ""

import pytest  # noqa: E402
import torch  # noqa: E402

import ratex  # noqa: E402,F401  (registers the lazy device)
from ratex.lazy_tensor_core.debug import metrics  # noqa: E402


@pytest.fixture
def dev():
    """The lazy device, with counters reset."""
    metrics.reset()
    return torch.device("lazy", 0)
