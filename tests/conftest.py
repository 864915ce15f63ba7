"""Test set-up shared by every test module.

Without a GPU, Triton kernels run through its interpreter on CPU tensors. The variable must be
set before triton (or any module defining a ``@triton.jit`` kernel) is imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread: the suite runs beside other work on a 2-core machine, and results
# must not depend on how a reduction is split across threads.
torch.set_num_threads(1)

import pytest  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    """Every device the machine has: CPU always, CUDA when present."""
    return request.param
