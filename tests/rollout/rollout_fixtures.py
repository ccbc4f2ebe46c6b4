"""Tiny models and a character tokenizer for the rollout tests (random weights, nothing downloaded).

A uniquely named module (not conftest) so `from rollout_fixtures import ...` cannot pick up another
directory's conftest.
"""
import contextlib

from transformers import Qwen3MoeConfig

from megatron_s3ac.models.tiny_models import char_tokenizer as _char_tokenizer

CHARS = "0123456789+=abcdefghijklmnopqrstuvwxyz .,"


def char_tokenizer():
    """One token per character of CHARS (shared implementation in megatron_s3ac.testing)."""
    return _char_tokenizer(CHARS)


def tiny_moe_config(**overrides) -> Qwen3MoeConfig:
    """3 layers, layer 1 dense (so the R3 layout's dense-layer rows are exercised), 8 experts, top-2."""
    kwargs = dict(vocab_size=len(CHARS) + 3, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                  num_hidden_layers=3, mlp_only_layers=[1], num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, num_experts=8, num_experts_per_tok=2, eos_token_id=1, pad_token_id=0,
                  bos_token_id=2, tie_word_embeddings=False, max_position_embeddings=256,
                  initializer_range=0.2)  # larger than HF's 0.02: no near-ties in the router
    kwargs.update(overrides)
    return Qwen3MoeConfig(**kwargs)


@contextlib.contextmanager
def local_ray_by_value(module):
    """A local 2-CPU Ray session (unless one is already up; then that one, left running) in which ``module``'s
    test-local engine classes travel to the actors by value."""
    import ray

    ray.cloudpickle.register_pickle_by_value(module)
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.cloudpickle.unregister_pickle_by_value(module)
        if started:
            ray.shutdown()
