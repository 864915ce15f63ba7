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
# Triton runs kernels on CPU tensors only in its interpreter. On a GPU machine the interpreter
# is off (the compiled kernels are what is tested there), so the CPU cases of Triton paths skip.
TRITON_ON_CPU = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_PATHS = ("triton", "kernel")  # test_accumulate's `path` values that launch Triton


def pytest_configure(config):
    config.addinivalue_line("markers", "triton: launches Triton kernels on the test's `device`")


def pytest_sessionstart(session):
    """Builds the C++ extension before the first test, if this machine has no build of it yet:
    minutes once, which would otherwise land inside whichever test first needs it (and inside
    the time limits of the tests that start ranks)."""
    from gradaccel.ops import extension

    extension.load()


def pytest_collection_modifyitems(config, items):
    if TRITON_ON_CPU:
        return
    skip = pytest.mark.skip(reason="Triton runs CPU tensors only in its interpreter (TRITON_INTERPRET=1, "
                                   "set where there is no GPU); the CUDA case runs here instead")
    for item in items:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        if params.get("device") == "cpu" and (params.get("path") in TRITON_PATHS or item.get_closest_marker("triton")):
            item.add_marker(skip)


@pytest.fixture(params=DEVICES)
def device(request):
    """Every device the machine has: CPU always, CUDA when present."""
    return request.param
