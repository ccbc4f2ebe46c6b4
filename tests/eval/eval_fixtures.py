"""A tiny model + character tokenizer for the eval tests, and a synthetic "a+b=" benchmark.

The vocabulary is only digits, "+", "=" and the specials (15 tokens), so even a random model
answers a one-digit sum correctly about 1 time in 15: pass rates are small but not zero.
(A uniquely named module, not conftest, so imports cannot pick up another directory's helpers.)
"""
import os
import random
import time


from megatron_s3ac.rollout.rewards import register_reward
from megatron_s3ac.models.tiny_models import char_tokenizer as _char_tokenizer
from megatron_s3ac.models.tiny_models import save_tiny_hf

SLEEP_REWARD = "eval_test_sleep_forever"

CHARS = "0123456789+="


def char_tokenizer():
    """One token per character of CHARS (shared implementation in megatron_s3ac.testing)."""
    return _char_tokenizer(CHARS)


def save_tiny_model(out_dir: str) -> str:
    """A random tiny qwen3 with the char tokenizer saved alongside (an HF directory)."""
    save_tiny_hf("qwen3", out_dir, seed=0, vocab_size=len(CHARS) + 3, eos_token_id=1, pad_token_id=0,
                 bos_token_id=2)
    char_tokenizer().save_pretrained(out_dir)
    return out_dir


def arithmetic_rows(n: int, seed: int = 0) -> list[dict]:
    """n one-digit-sum prompts "a+b=" with answer a+b < 10 (the CPU demo's task, shortened)."""
    rng = random.Random(seed)  # local: the global stream is what the RNG tests watch
    rows = []
    for _ in range(n):
        a = rng.randint(0, 9)
        b = rng.randint(0, 9 - a)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "benchmarks")


# Module level so the reward pool's worker processes can import it by reference.
@register_reward(SLEEP_REWARD)
def sleep_forever(response, reference):
    """A verifier that never returns: every answer it scores must hit the pool's time limit."""
    time.sleep(3600)
    return 1.0
