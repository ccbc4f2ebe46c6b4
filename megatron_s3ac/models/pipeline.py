"""Forward (and backward) over micro-batches through megatron's pipeline schedules.

One entry point for every model pass of the trainer (log-probs, values, updates) at any PP size.
A micro-batch is a dict with ``input_ids`` [b, s], optional ``position_ids`` and ``attention_mask``
(megatron convention: bool, True = masked, [b, 1, s, s]; None = causal), optional ``images`` (one
``models.multimodal.ImageInputs`` or None per row: the vision tower's embeddings go into the decoder
input and the positions become 3-D mRoPE ones, models/vision.py), plus whatever the loss needs.

``loss_fn(batch, output) -> (loss_sum, num_tokens, metrics_dict)`` runs on the last stage. With
``config.calculate_per_token_loss`` on (set by ``prepare_config``), megatron neither divides by the
number of micro-batches nor averages over DP; ``finalize_model_grads`` divides the summed gradients by
the total token count of the whole mini-batch across micro-batches and DP ranks: a true global
token-mean, as the algorithms require.

Context parallel (cp > 1): the model sees this CP rank's two chunks of ``input_ids`` / ``position_ids``
(``context_parallel.split_for_cp``; the attention mask stays whole), so ``loss_fn`` receives the
output of the rank's tokens [b, s / cp, ...]. megatron sums gradients and ``num_tokens`` over the
DP x CP group: a loss_fn returns either its own tokens' sum and count, or (after
``context_parallel.gather_from_cp``) the whole sequence's, with the count on CP rank 0 only.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from megatron_s3ac.models.context_parallel import cp_group_info, split_for_cp


def prepare_config(config) -> None:
    """Settings every model of this project trains with (see module docstring)."""
    config.calculate_per_token_loss = True
    config.variable_seq_lengths = True  # micro-batches may differ in length (PP shapes are exchanged)


def _forward_step(data_iterator, model, loss_fn):
    batch = next(data_iterator)
    ids = batch["input_ids"]
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
    _, cp, _ = cp_group_info()
    if cp > 1 and ids.shape[1] % (2 * cp):
        raise ValueError(f"context parallel cp={cp}: micro-batch length {ids.shape[1]} is not a multiple of "
                         f"2 x cp (pad to the layout's seq_multiple)")
    kw = {}
    if batch.get("images") is not None:  # image prompts: 3-D mRoPE positions, vision embeddings in the input
        from megatron_s3ac.models.vision import model_inputs

        mm = model_inputs(model, batch, ids)
        if mm is not None:
            pos, dec = mm
            if dec is not None:
                kw["decoder_input"] = dec  # this CP rank's (and SP rank's) part already
    if cp > 1:
        ids, pos = split_for_cp(ids, 1), split_for_cp(pos, pos.ndim - 1)
    out = model(ids, pos, batch.get("attention_mask"), **kw)
    return out, partial(loss_fn, batch)


def forward_backward(model_chunks: list[torch.nn.Module], microbatches: list[dict],
                     loss_fn: Callable, forward_only: bool = False) -> list[dict]:
    """Run all micro-batches through the schedule. Returns the per-micro-batch metrics dicts
    (non-empty on the last pipeline stage only). Gradients accumulate in the DDP buffers."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not microbatches:
        return []
    fb = get_forward_backward_func()
    s = microbatches[0]["input_ids"].shape[1]
    b = microbatches[0]["input_ids"].shape[0]
    return fb(forward_step_func=partial(_forward_step, loss_fn=loss_fn), data_iterator=iter(microbatches),
              model=model_chunks if len(model_chunks) > 1 else model_chunks[0],
              num_microbatches=len(microbatches), seq_length=s, micro_batch_size=b,
              forward_only=forward_only)
