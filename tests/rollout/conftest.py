"""Fixtures and markers for the rollout tests."""
import pytest
import torch

from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine
from rollout_fixtures import char_tokenizer, tiny_moe_config


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: slower than a few seconds on 2 CPU cores")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (and sglang installed)")


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def moe_engine(tokenizer):
    torch.manual_seed(0)
    return CPUEngine.from_config(tiny_moe_config(), tokenizer=tokenizer, seed=0)
