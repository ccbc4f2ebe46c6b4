"""Tiny random HF checkpoints (hub layout) and their converted torch_dist checkpoints, per session."""
import pytest

from megatron_s3ac.testing.tiny_models import save_tiny_hf

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
    from megatron_s3ac.convert import hf_to_mcore

    root = tmp_path_factory.mktemp("mcore")
    out = {}
    for name, d in hf_dirs.items():
        out[name] = str(root / name)
        hf_to_mcore(d, out[name], workers=2, progress=False)
    return out
