"""Weight sync trainer -> rollout engine: a thin adapter over the converter's in-memory export.

``megatron_s3ac.convert.export_hf_weights`` holds the project's one megatron->HF name mapping per
architecture (the same ``Plan`` the offline hf<->mcore converters use) and works for any TP/EP/ETP
layout. It yields buckets: on each pipeline stage's leader a list of full ``(hf_name, tensor)``, on
every other rank ``[]``. The trainer's engine lives on global rank 0 (the leader of the first
stage), and wants a flat stream of pairs, which is all this adapter adds.

Collective: every rank of the pipeline stage must iterate the generator to the end, in lockstep.
With PP > 1 each stage's leader gets only its own stage's layers, so an engine on rank 0 would miss
the others: refused until the trainer gathers stages (docs/trainer.md, "left").
"""
from __future__ import annotations

from typing import Iterator

import torch


def export_hf_weights(model, info, bucket_bytes: int = 256 << 20) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, full tensor) pairs of the live sharded ``model`` (a module or a list of VPP chunks);
    non-leader ranks yield nothing but must still iterate to the end."""
    from megatron.core import parallel_state as ps

    from megatron_s3ac.convert import export_hf_weights as _export

    if ps.get_pipeline_model_parallel_world_size() > 1:
        raise NotImplementedError("weight sync to an engine on rank 0 with pp > 1 needs the pipeline stages "
                                  "gathered to rank 0; not implemented in the trainer yet")
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    for bucket in _export(chunks, info, bucket_bytes):
        yield from bucket
