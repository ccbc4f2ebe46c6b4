"""Tiny Qwen3.5-MoE checkpoints (both HF variants / expert layouts) and their torch_dist conversions."""
import pytest

from tests.convert._common import convert_all
from megatron_s3ac.models.tiny_qwen3_5 import save_tiny_qwen3_5

# name -> (variant, expert layout, seed)
MODELS = {"vl": ("vl", "fused", 0), "text": ("text", "per_expert", 1)}


@pytest.fixture(scope="session")
def q35_hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("q35_hf")
    return {n: save_tiny_qwen3_5(str(root / n), v, e, seed=s) for n, (v, e, s) in MODELS.items()}


@pytest.fixture(scope="session")
def q35_mcore(q35_hf, tmp_path_factory):
    return convert_all(q35_hf, tmp_path_factory.mktemp("q35_mcore"))
