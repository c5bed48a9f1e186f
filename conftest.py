"""Test tiers: CPU unit tests, generated kernels in Triton's interpreter (no GPU), GPU tests.

Without a GPU, TRITON_INTERPRET=1 is set for the whole session before anything imports Triton, so
the generated kernels run on CPU tensors. Tests marked `gpu` skip with a reason. Every session gets
an empty kernel and proof cache, so no test passes on what an earlier run left behind.
"""
import os
import tempfile

import pytest
import torch

os.environ["SCANLANG_CACHE_DIR"] = tempfile.mkdtemp(prefix="scanlang-test-cache-")
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is present (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
