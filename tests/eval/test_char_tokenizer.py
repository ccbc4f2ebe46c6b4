"""The demo's character vocabulary saved as an HF tokenizer: same ids as CharVocab, loadable by
AutoTokenizer, specials skipped on decode, an unknown character refused (hand-derived ids)."""
import random

import pytest
from transformers import AutoTokenizer

from megatron_s3ac.data.char_tokenizer import char_vocab_tokenizer, save_char_tokenizer
from megatron_s3ac.data.prompts import BOS, EOS, PAD, CharVocab


def test_ids_equal_char_vocab(tmp_path):
    vocab = CharVocab()
    out = save_char_tokenizer(vocab, str(tmp_path / "tok"))
    tok = AutoTokenizer.from_pretrained(out)
    # hand-derived: "0".."9" are 3..12, "+" 13, "=" 14; <bos> prepended as the trainer's prompts
    assert tok("12+34=")["input_ids"] == [BOS, 4, 5, 13, 6, 7, 14]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD, BOS, EOS) == (0, 1, 2)
    assert len(tok) == vocab.size == 15
    rng = random.Random(0)
    for _ in range(50):
        s = "".join(rng.choice(vocab.chars) for _ in range(rng.randint(1, 12)))
        assert tok(s, add_special_tokens=False)["input_ids"] == vocab.encode(s)
        ids = [BOS] + vocab.encode(s) + [EOS, PAD]
        assert tok.decode(ids, skip_special_tokens=True) == vocab.decode(ids) == s


def test_other_character_sets_and_unknown_characters():
    vocab = CharVocab("0123456789+=,")
    tok = char_vocab_tokenizer(vocab)
    assert tok("1+2=3,", add_special_tokens=False)["input_ids"] == [4, 13, 5, 14, 6, 15]
    with pytest.raises(Exception, match="UNK|unk"):
        tok("1*2")  # no <unk> id exists in the model's embedding: refused, not mapped
    with pytest.raises(ValueError, match="twice"):
        char_vocab_tokenizer(CharVocab("0120"))
