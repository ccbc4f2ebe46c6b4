"""A reward that is slow for some answers (tests/rollout/test_streaming.py). Its own light module: the reward pool's
worker processes import it by name to run it, without the test module's heavy imports (torch, ray)."""
import time

from megatron_s3ac.rollout.rewards import register_reward

SLOW_S = 6.0  # against a few ms per answer (seconds on a machine at load 40)


@register_reward("test_slow_when_a")
def slow_when_a(response, reference):
    """+1 iff response == reference; an answer starting with "a" takes SLOW_S seconds to score."""
    if response.startswith("a"):
        time.sleep(SLOW_S)
    return 1.0 if response == reference else -1.0
