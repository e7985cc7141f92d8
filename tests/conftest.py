"""Shared pytest set-up: ``@pytest.mark.cuda`` tests skip on machines without a CUDA GPU; the ``one_thread`` fixture."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: tiny matmuls on a shared 2-core machine run faster without them."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
