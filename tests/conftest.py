import os
import sys

import pytest
import torch

# Make `tests.reference` importable as `reference` regardless of the rootdir.
sys.path.insert(0, os.path.dirname(__file__))

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def c_switch(name):
    """The kvquant_ext._C 0/1 switch `name` as f(mode=-1): mode 0 / 1 sets it, -1 leaves it;
    returns the previous mode (-1 on a build without CUDA)."""
    def switch(mode=-1):
        from kvquant_ext import _C
        return getattr(_C, name)(mode)
    return switch


def restoring(switch, name):
    """A fixture called `name` that puts `switch` back as it was after the test."""
    @pytest.fixture(name=name)
    def fixture():
        prev = switch()
        yield
        switch(prev)
    return fixture
