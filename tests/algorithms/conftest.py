"""Shared settings for the algorithm-core tests (pure torch, CPU, fast)."""
import os
import sys

import pytest
import torch

# make the sibling helper module (_algo_reference) importable under any --import-mode
sys.path.insert(0, os.path.dirname(__file__))
from hypothesis import settings

settings.register_profile("algorithms", max_examples=40, deadline=None, derandomize=True)
settings.load_profile("algorithms")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: longer-running test (deselect with -m 'not slow')")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
