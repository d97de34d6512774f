"""Kernel tests run the Triton kernels compiled on a GPU, or in Triton's CPU interpreter otherwise.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is defined, so it is set here, before any test
module of this folder imports a kernel module (only these tests import them directly; the dispatch layer
imports them lazily and only for CUDA tensors). It selects how the kernels execute, not what they compute.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernel_helpers import DEVICE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def device():
    return DEVICE
