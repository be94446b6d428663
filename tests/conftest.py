import os
import sys

import pytest
import torch

import kvquant_ext as kvq

# Make `tests.reference` importable as `reference` regardless of the rootdir.
sys.path.insert(0, os.path.dirname(__file__))

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

# The supported sets the build declares.  MMA_HEAD_DIMS (the tensor-core kernels' head dims)
# is the required set {64, 128, 256}: a test that covers only those uses it.
HEAD_DIMS = kvq.HEAD_DIMS
MMA_HEAD_DIMS = kvq.MMA_HEAD_DIMS
BITS = kvq.BITS
DTYPES = kvq.DTYPES


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
