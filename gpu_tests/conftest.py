"""gpu_tests/: the CUDA path on a real GPU (``make gpu-test``; not part of ``make test``,
since CI has no GPU). Without a CUDA device every test here fails rather than skips: a
GPU run that silently ran nothing would read as a pass."""

import pytest
import torch


@pytest.fixture(autouse=True)
def cuda_required():
    if not torch.cuda.is_available():
        pytest.fail("gpu_tests need a CUDA device (torch.cuda.is_available() is False)")
