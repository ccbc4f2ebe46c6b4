"""Shared fixtures for the eval tests: one reward pool and one tiny model per session."""
import pytest

from eval_fixtures import char_tokenizer, save_tiny_model
from megatron_s3ac.rollout.rewards import RewardPool

VERIFIER_TIMEOUT_S = 2.0


@pytest.fixture(scope="session")
def pool():
    with RewardPool(num_workers=2, timeout_s=VERIFIER_TIMEOUT_S) as p:
        yield p


@pytest.fixture(scope="session")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny_qwen3")))


@pytest.fixture(scope="session")
def engine(model_dir, tokenizer):
    from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine

    return CPUEngine.from_pretrained(model_dir, tokenizer=tokenizer)
