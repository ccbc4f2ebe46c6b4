"""The config's choice enums and its error (``config`` re-exports them)."""
from __future__ import annotations

import contextlib
import contextvars
import enum
import os

_CHECK_PATHS = contextvars.ContextVar("s3ac_config_check_paths", default=True)


@contextlib.contextmanager
def paths_elsewhere():
    """Within: the config checks do not ask whether its files exist (a config whose files live on the cluster,
    checked here for everything else: ``s3ac-train rehearse``)."""
    token = _CHECK_PATHS.set(False)
    try:
        yield
    finally:
        _CHECK_PATHS.reset(token)


def path_missing(path, directory: bool = False) -> bool:
    """True when ``path`` (not None) should exist here and does not (a directory when ``directory``)."""
    if path is None or not _CHECK_PATHS.get():
        return False
    return not (os.path.isdir(path) if directory else os.path.exists(path))


class ConfigError(ValueError):
    """An invalid experiment config; the message lists every broken rule by its dotted key."""


# choices OmegaConf checks (a str Enum: members compare equal to their names)
class Task(str, enum.Enum):
    arithmetic = "arithmetic"
    multistep = "multistep"  # multi-operand arithmetic written step by step (tasks.multistep)
    chain = "chain"  # digit chains with 12-32-token answers: cumsum, add, reverse, sort, runsum (tasks.chain)
    math = "math"


class Placement(str, enum.Enum):
    colocated = "colocated"
    separate = "separate"


class EngineKind(str, enum.Enum):  # the built-in kinds; rollout.engine itself is any registered kind (a string)
    cpu = "cpu"  # transformers' model in this project's engine (rollout.engines.cpu.engine), on the CPU
    hf = "hf"  # the same engine on rank 0's GPU in model.dtype when CUDA is present
    sglang = "sglang"
    vllm = "vllm"  # a real vLLM engine in its own environment (rollout.vllm; make vllm-env; docs/rollout.md)


class WeightsDtype(str, enum.Enum):  # the rollout engine's weights (docs/fp8.md)
    bf16 = "bf16"  # the trainer's weights as they are, unquantized
    fp8 = "fp8"  # block-scaled e4m3 + weight_scale_inv, quantized at every weight sync (SGLang's layout)


class CriticHead(str, enum.Enum):
    linear = "linear"
    bounded = "bounded"


class CriticPrivileged(str, enum.Enum):
    """What the critic sees beside the policy's input (BPCO notes sec. 3.6 / 4, eq. 13: V(s_t, q(x)))."""
    none = "none"
    answer = "answer"
    answer_and_solution = "answer_and_solution"


class TinyModel(str, enum.Enum):
    arithmetic_moe = "arithmetic_moe"


class DType(str, enum.Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class Recompute(str, enum.Enum):
    none = "none"
    selective = "selective"
    full = "full"


def _missing_paths(section: str, obj, keys) -> list[str]:
    return [f"{section}.{k}={getattr(obj, k)!r} does not exist" for k in keys
            if path_missing(getattr(obj, k))]


class Stage(str, enum.Enum):  # trainer.stages.pipeline's stages, in order
    warmup = "warmup"
    coverage = "coverage"
    value_pretrain = "value_pretrain"
    rl = "rl"


R3_MODES = ("auto", "on", "off")
