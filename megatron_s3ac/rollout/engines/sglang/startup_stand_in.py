"""A stand-in for ``sglang.Engine``'s start-up (sglang 0.5.23), for tests and ``s3ac-train rehearse``:
how engines are configured and launched.

``StartupEngine(**server_args)`` is what ``SGLangEngine(engine_cls=...)`` calls instead of ``sglang.Engine``. It
serves no requests; it reproduces the start-up checks a real engine makes in its own process and records what it
was started with (``server_args``, the engine-relevant part of its process environment, its pid), so a test can
ask an engine actor what it saw:

* ``context_length`` above the model's derived context length (``get_context_length``:
  utils/hf_transformers/common.py:668-694, here ``sglang_engine._context_length``) raises ValueError unless the
  engine process has SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN set true (configs/model_config.py:1291-1316; the
  variable is parsed by ``EnvBool``, environ.py:143-151, and read in the engine's process, not the caller's).
* ``enable_return_routed_experts`` is accepted as is (the wrapper's own check refuses it for a dense model).

Weight updates and memory calls succeed and load nothing; ``generate`` is not served (use tests/rollout's
fake_sglang for that).
"""
from __future__ import annotations

import json
import os
from typing import Optional

# what an engine process's environment is asked for (prefixes)
ENV_PREFIXES = ("SGLANG_", "NCCL_", "S3AC_")


def _env_true(value: Optional[str]) -> bool:
    """sglang's EnvBool (environ.py:143-151): true/1/yes/y; false/0/no/n; anything else raises."""
    if value is None:
        return False
    v = value.lower()
    if v in ("true", "1", "yes", "y"):
        return True
    if v in ("false", "0", "no", "n"):
        return False
    raise ValueError(f'"{value}" is not a valid boolean value')


class StartupEngine:
    """sglang.Engine(**server_args) as far as start-up goes (see the module docstring)."""

    def __init__(self, model_path: str, context_length: Optional[int] = None, **server_args):
        from megatron_s3ac.rollout.engines.sglang.engine import _context_length

        self.server_args = dict(model_path=model_path, context_length=context_length, **server_args)
        self.env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
        self.pid = os.getpid()
        with open(os.path.join(model_path, "config.json")) as f:
            hf = json.load(f)
        derived = _context_length(hf.get("text_config") or hf)
        if context_length is not None and context_length > derived:
            msg = (f"Warning: User-specified context_length ({context_length}) is greater than the derived "
                   f"context_length ({derived}). This may lead to incorrect model outputs or CUDA errors.")
            if not _env_true(os.environ.get("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN")):
                raise ValueError(f"{msg} To allow overriding this maximum, set the env var "
                                 f"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1")
        self.context_len = int(context_length or derived)
        self._offloaded: set = set()

    # what the wrapper calls outside generation: all succeed (sglang returns (success, message) / an object)
    def begin_weight_update(self, selector: str = "all"):
        return True, "Success"

    def end_weight_update(self):
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        return True, "Success"

    def flush_cache(self):
        return True

    def release_memory_occupation(self, tags=None):
        self._offloaded.update(tags or ("kv_cache", "weights", "cuda_graph"))

    def resume_memory_occupation(self, tags=None):
        self._offloaded.difference_update(tags or ("kv_cache", "weights", "cuda_graph"))

    def shutdown(self):
        return None

    def startup_record(self) -> dict:
        """What this engine was started with: server_args, its engine-relevant environment, its pid."""
        return {"server_args": dict(self.server_args), "env": dict(self.env), "pid": self.pid}
