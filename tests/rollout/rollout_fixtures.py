"""Tiny models and a character tokenizer for the rollout tests (random weights, nothing downloaded).

A uniquely named module (not conftest) so `from rollout_fixtures import ...` cannot pick up another
directory's conftest.
"""
from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig

CHARS = "0123456789+=abcdefghijklmnopqrstuvwxyz .,"


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; ids 0/1/2 are <pad>/<eos>/<bos>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    for c in CHARS:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")


def tiny_moe_config(**overrides) -> Qwen3MoeConfig:
    """3 layers, layer 1 dense (so the R3 layout's dense-layer rows are exercised), 8 experts, top-2."""
    kwargs = dict(vocab_size=len(CHARS) + 3, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                  num_hidden_layers=3, mlp_only_layers=[1], num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, num_experts=8, num_experts_per_tok=2, eos_token_id=1, pad_token_id=0,
                  bos_token_id=2, tie_word_embeddings=False, max_position_embeddings=256,
                  initializer_range=0.2)  # larger than HF's 0.02: no near-ties in the router
    kwargs.update(overrides)
    return Qwen3MoeConfig(**kwargs)
