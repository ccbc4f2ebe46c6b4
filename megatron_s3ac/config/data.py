"""The ``data`` section."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional
from megatron_s3ac.config.enums import Task, path_missing


@dataclass
class DataCfg:
    task: Task = Task.arithmetic
    path: Optional[str] = None  # jsonl / parquet (DAPO-Math-17k or MATH-1460 schema)
    num_prompts: int = 2000  # arithmetic: size of the synthetic train set
    eval_prompts: int = 200  # arithmetic: held-out set for pass rates
    max_operand: int = 99
    # multistep task: operands per prompt in [min_operands, max_operands], operators drawn from ops
    min_operands: int = 3
    max_operands: int = 5
    ops: str = "+"
    # chain task: the kind (tasks.chain.KINDS) and the chain length in [min_len, max_len]
    chain: str = "cumsum"
    min_len: int = 12
    max_len: int = 12
    max_prompt_tokens: int = 1024
    apply_chat_template: bool = True
    seed: int = 1
    # a JSON file {"prompt_ids": [[id, ...], ...]}: the RL stage draws only these prompts of the set (the warm-up and
    # coverage stages see the whole set); tools/sanity_test.py writes it from a coverage pass
    prompt_subset: Optional[str] = None

    def errors(self) -> list[str]:
        if self.prompt_subset is not None and path_missing(self.prompt_subset):
            return [f"data.prompt_subset={self.prompt_subset!r} does not exist"]
        if self.task == Task.math and (self.path is None or path_missing(self.path)):
            return [f"data.path={self.path!r} does not exist (task=math needs a jsonl/parquet prompt set)"]
        if self.task == Task.multistep:
            from megatron_s3ac.tasks.multistep import spec_of

            try:
                spec_of(self)
            except ValueError as e:
                return [f"data (task=multistep): {e}"]
        if self.task == Task.chain:
            from megatron_s3ac.tasks.chain import spec_of as chain_spec_of

            try:
                chain_spec_of(self)
            except ValueError as e:
                return [f"data (task=chain): {e}"]
        return []
