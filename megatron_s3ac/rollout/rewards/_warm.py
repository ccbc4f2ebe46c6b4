"""Imported only by the reward pool's forkserver: warms math-verify up once, so every worker forked
from it starts with the LaTeX grammar and sympy caches already built."""
from megatron_s3ac.rollout.rewards import _warm_up

_warm_up()
