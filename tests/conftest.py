import os

import pytest
import torch

if not torch.cuda.is_available():
    # Before any test module imports triton: the interpreter is chosen when the kernels are decorated, so whichever
    # file pytest collects first must not decide it (test_triton_backend.py and test_ascend.py need it).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
