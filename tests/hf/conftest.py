"""Fixtures of the hf tests (helpers live in ``hf_helpers``)."""

import pytest
import torch

from hf_helpers import ARCHS


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture(autouse=True)
def _no_grad_one_thread():
    # Tiny-model ops are dominated by OpenMP start-up on a shared 2-core machine: one thread is ~100x faster.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_num_threads(threads)
