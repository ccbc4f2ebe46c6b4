"""The toy tasks, one module per task holding its prompts and its reward: ``arithmetic`` ("a+b=", the CPU demo),
``chain`` (digit chains), ``multistep`` (running sums), ``vision`` (digits drawn in images; reward "arithmetic").

``REWARDS``: each task's reward, registered by rollout.rewards (which imports this package, never the reverse).
Importing this package loads no torch (the reward workers import it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megatron_s3ac.data.prompts import tiny_arithmetic_hf_config
from megatron_s3ac.tasks import arithmetic, chain, multistep


@dataclass(frozen=True)
class TaskReward:
    name: str  # rollout.reward / eval.reward
    fn: Callable[[str, str], float]  # (response, reference) -> +1.0 / -1.0
    isolate: bool = False  # False: scored inline (bounded string operations); True: in a RewardPool worker


REWARDS = (TaskReward(arithmetic.REWARD, arithmetic.arithmetic_reward),
           TaskReward(chain.REWARD, chain.chain_reward),
           TaskReward(multistep.REWARD, multistep.multistep_reward))


def tiny_hf_config(data_cfg):
    """The tiny demo model's HF config for ``data.task`` (the vocabulary differs per task)."""
    task = str(getattr(data_cfg.task, "value", data_cfg.task))
    if task == "multistep":
        return multistep.tiny_multistep_hf_config(multistep.spec_of(data_cfg))
    if task == "chain":
        return chain.tiny_chain_hf_config(chain.spec_of(data_cfg))
    return tiny_arithmetic_hf_config()
