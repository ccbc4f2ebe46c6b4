"""The run's input files, read once before any process group, engine or model is built (``s3ac-train``, on every
rank alike, so all ranks exit 2 together): the model's HF config and weights, the torch_dist checkpoints of
``model.actor_init`` / ``model.critic_init``, the prompt set of ``data.path`` (every row through the tokenizer) and,
for ``value-pretrain``, the coverage jsonl. A bad one is a ``ConfigError`` naming the key and the file (and row),
raised before ``train.out_dir`` holds anything.
"""
from __future__ import annotations

import os

from megatron_s3ac.config import Config, ConfigError, engine_model_dir


def check_inputs(cfg: Config, cmd: str) -> None:
    """ConfigError ``"<key>: <file>[ row N]: <why>"`` for the first unusable input of ``cmd``'s run."""
    from megatron_s3ac.convert.dcp_meta import check_torch_dist
    from megatron_s3ac.convert.safetensors_io import check_weight_files
    from megatron_s3ac.models.registry import model_info

    m = cfg.model
    key = "model.hf_config"
    try:
        if m.hf_config:
            model_info(m.hf_config)
        hf_dir = engine_model_dir(cfg)
        if hf_dir and os.path.isdir(hf_dir):
            key = "model.engine_hf_dir" if m.engine_hf_dir else "model.hf_config"
            check_weight_files(hf_dir)
        for key in ("model.actor_init", "model.critic_init"):
            if getattr(m, key.split(".")[1]):
                check_torch_dist(getattr(m, key.split(".")[1]))
        key = "data.path"
        if cfg.data.task == "math":
            _check_prompts(cfg)
        key = "value_pretrain.coverage_path"
        if cmd == "value-pretrain":
            if not cfg.value_pretrain.coverage_path:
                raise ValueError("value-pretrain needs it (a coverage jsonl: tools/build_coverage_data.py)")
            from megatron_s3ac.data.prompts import read_coverage

            read_coverage(cfg.value_pretrain.coverage_path)
    except (ValueError, OSError) as err:  # UnsupportedModelError is a ValueError
        raise ConfigError(f"{key}: {err}") from None


def _check_prompts(cfg: Config) -> None:
    """Every row of ``data.path`` read and tokenized as the Trainer will (images are not decoded here)."""
    from transformers import AutoTokenizer

    from megatron_s3ac.data import prompts as D

    model_dir = cfg.model.engine_hf_dir or cfg.model.hf_config
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds for a directory without a tokenizer
        raise ValueError(f"{model_dir}: cannot load its tokenizer ({type(err).__name__}: {err})") from None
    vision = D.VisionProcessor.from_pretrained(model_dir) if os.path.isdir(model_dir) else None
    mode = getattr(cfg.model.critic_privileged, "value", cfg.model.critic_privileged)
    try:
        prompts, _ = D.load_math_prompts(cfg.data.path, tok, cfg.data.max_prompt_tokens, cfg.data.apply_chat_template,
                                         vision=vision, expand_images=False)
    except ValueError:
        if mode != "none":  # every row unusable: say whether the critic's field is what the rows lack
            rows = D._read_rows(cfg.data.path)
            missing = sum(1 for r in rows if isinstance(r, dict) and str(D.row_reference(r) or "").strip() == "")
            if missing:
                raise ValueError(f"{cfg.data.path}: model.critic_privileged={mode} needs each row's reference "
                                 f"answer, and {missing} of its {len(rows)} rows carry none") from None
        raise
    if mode == "answer_and_solution" and not any(p.solution for p in prompts):
        raise ValueError(f"{cfg.data.path}: model.critic_privileged=answer_and_solution needs a solution column, and "
                         f"none of its {len(prompts)} usable rows carries one (or use model.critic_privileged=answer)")

