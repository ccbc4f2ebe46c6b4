"""Tiny random HF checkpoints (hub layout) and their converted torch_dist checkpoints, per session."""
import pytest

from megatron_s3ac.models.tiny_models import save_tiny_hf
from tests.convert._common import convert_all

# name -> (model_type, config overrides)
MODELS = {
    "qwen2_tied": ("qwen2", {}),
    "qwen2_untied": ("qwen2", {"tie_word_embeddings": False}),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", {}),
}


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: save_tiny_hf(mt, str(root / name), seed=i, **kw)
            for i, (name, (mt, kw)) in enumerate(MODELS.items())}


@pytest.fixture(scope="session")
def mcore_dirs(hf_dirs, tmp_path_factory):
    return convert_all(hf_dirs, tmp_path_factory.mktemp("mcore"))
