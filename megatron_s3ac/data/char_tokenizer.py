"""The character vocabulary (``data.prompts.CharVocab``) as a real Hugging Face tokenizer.

The CPU demo trains on a tokenizer-free vocabulary: ids 0/1/2 are PAD/BOS/EOS and character i of
``vocab.chars`` is id 3 + i. A model saved without a tokenizer cannot be evaluated by HF tools:
transformers then builds the model type's default tokenizer with an empty vocabulary, which decodes
every response to "" (how ``s3ac-eval`` scored the demo's model 0%). ``save_char_tokenizer`` writes
the same ids as a ``PreTrainedTokenizerFast`` next to the model, so ``AutoTokenizer.from_pretrained``
loads it and ``tokenizer(text)["input_ids"] == [BOS] + vocab.encode(text)`` (the demo's prompt ids).
"""
from __future__ import annotations

import os

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<bos>", "<eos>"


def char_vocab_tokenizer(vocab, model_max_length: int | None = None):
    """A ``PreTrainedTokenizerFast`` with exactly ``vocab``'s ids (len == vocab.size).

    One token per character (WordLevel model over a split into single characters); decoding fuses
    the characters without spaces. A character outside the vocabulary raises (no <unk> id exists in
    the model's embedding, and silently mapping it to another id would corrupt prompts).
    add_special_tokens=True prepends <bos>, as the trainer's prompts do.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from megatron_s3ac.data.prompts import BOS, EOS, PAD

    ids = {PAD_TOKEN: PAD, BOS_TOKEN: BOS, EOS_TOKEN: EOS}
    for i, c in enumerate(vocab.chars):
        if c in ids:
            raise ValueError(f"character {c!r} appears twice in the vocabulary")
        ids[c] = 3 + i
    if sorted(ids.values()) != list(range(vocab.size)):
        raise ValueError(f"vocabulary ids {sorted(ids.values())} are not 0..{vocab.size - 1}")
    tok = Tokenizer(models.WordLevel(ids))  # no unk_token: an unknown character is an error
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B",
                                                       special_tokens=[(BOS_TOKEN, BOS)])
    kw = {"model_max_length": model_max_length} if model_max_length else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD_TOKEN, bos_token=BOS_TOKEN,
                                   eos_token=EOS_TOKEN, **kw)


def save_char_tokenizer(vocab, out_dir: str, model_max_length: int | None = None) -> str:
    """Write ``vocab`` as HF tokenizer files into ``out_dir`` (e.g. next to the demo's saved model);
    verifies the round trip (reloaded with AutoTokenizer, same ids) before returning ``out_dir``."""
    from transformers import AutoTokenizer

    tok = char_vocab_tokenizer(vocab, model_max_length)
    os.makedirs(out_dir, exist_ok=True)
    tok.save_pretrained(out_dir)
    back = AutoTokenizer.from_pretrained(out_dir)
    probe = vocab.chars
    if back(probe, add_special_tokens=False)["input_ids"] != vocab.encode(probe) or len(back) != vocab.size:
        raise RuntimeError(f"{out_dir}: the saved tokenizer does not reproduce the character vocabulary's ids")
    return out_dir
