"""Test-suite wide setup.

Without a GPU, Triton kernels run in Triton's CPU interpreter. ``TRITON_INTERPRET`` is read when a ``@triton.jit``
function is defined, so it is set here, before any test module imports a kernel module. It selects how kernels
execute, not what they compute; the dispatch layer still runs the PyTorch reference on CPU tensors unless a test
calls a kernel directly. Tests that run kernels in the interpreter carry the ``interpret`` marker.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
