import os

import pytest
import torch

import inplace_abn

BACKENDS = ["python"] + (["native"] if inplace_abn.HAS_NATIVE else [])


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device")
    config.addinivalue_line("markers", "slow: multi-process or long-running test")


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Run the test once per available backend."""
    with inplace_abn.use_backend(request.param):
        yield request.param


@pytest.fixture(autouse=True)
def _threads():
    # Two threads: the CI machine's cores, and a fixed count for reproducibility.
    torch.set_num_threads(2)
    yield
