"""The toy tasks, one module per task holding its prompts and its reward: ``arithmetic`` ("a+b=", the CPU demo),
``chain`` (digit chains), ``multistep`` (running sums), ``vision`` (digits drawn in images; reward "arithmetic").

``REWARDS``: each task's reward, registered by rollout.rewards (which imports this package, never the reverse).
``TASKS``: each character-vocabulary task by its ``data.task`` name: its prompt sets and its tiny model
(``toy_task``; the trainer asks it, never the name). Importing this package loads no torch (the reward workers
import it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megatron_s3ac.tasks import arithmetic, chain, multistep


@dataclass(frozen=True)
class TaskReward:
    name: str  # rollout.reward / eval.reward
    fn: Callable[[str, str], float]  # (response, reference) -> +1.0 / -1.0
    isolate: bool = False  # False: scored inline (bounded string operations); True: in a RewardPool worker


REWARDS = (TaskReward(arithmetic.REWARD, arithmetic.arithmetic_reward),
           TaskReward(chain.REWARD, chain.chain_reward),
           TaskReward(multistep.REWARD, multistep.multistep_reward))


@dataclass(frozen=True)
class ToyTask:
    name: str  # data.task
    data: Callable  # data_cfg -> (CharVocab, training prompts, held-out prompts), held-out drawn first (seed + 1)
    hf_config: Callable  # data_cfg -> the tiny demo model's HF config for the task's vocabulary and lengths


def _arithmetic_data(d):
    from megatron_s3ac.data.prompts import CharVocab

    held = arithmetic.arithmetic_prompts(d.eval_prompts, d.max_operand, d.seed + 1)
    return CharVocab(), arithmetic.arithmetic_prompts(d.num_prompts, d.max_operand, d.seed,
                                                      exclude={p.text for p in held}), held


TASKS = {t.name: t for t in (
    ToyTask("arithmetic", _arithmetic_data, lambda d: arithmetic.tiny_arithmetic_hf_config()),
    ToyTask("multistep", multistep.multistep_data, lambda d: multistep.tiny_multistep_hf_config(multistep.spec_of(d))),
    ToyTask("chain", chain.chain_data, lambda d: chain.tiny_chain_hf_config(chain.spec_of(d))))}


def toy_task(name) -> ToyTask | None:
    """The toy task ``data.task`` names (an enum or its string), None for a prompt file's task (math)."""
    return TASKS.get(str(getattr(name, "value", name)))


def tiny_hf_config(data_cfg):
    """The tiny demo model's HF config for ``data.task`` (the vocabulary differs per task; the demo's for math)."""
    task = toy_task(data_cfg.task) or TASKS["arithmetic"]
    return task.hf_config(data_cfg)
