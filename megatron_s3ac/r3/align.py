"""Sample routes -> the rows this rank's routers see, for one micro-batch.

Input: per sample, the rollout's routes ``[T-1, num_layers, top_k]`` (SGLang layout: row i = experts
used when token i was the model's input; the last token was never fed forward; dense layers' rows
are 0; ids logical). Output: per local MoE layer, ``[local_tokens, top_k]`` expert ids whose row order
is exactly the order megatron's ``TopKRouter.routing`` flattens its logits in. It is stored
layer-major ``[n_local_moe_layers, local_tokens, top_k]`` so each layer's indices are one
contiguous block (the per-layer int64 conversion is then a plain copy).

How the trainer's token layout maps onto router rows:
  * a micro-batch is ``input_ids [b, s]``; a sample occupies ``length`` tokens of one row from
    ``start`` (padded batch: row i from 0; packed: row 0 from cu_seqlens[i]; left padding: any start).
    ``length`` is T (all tokens fed: the last one gets a filler row) or T-1 (input = tokens[:-1]);
  * positions no sample covers (padding) and the last-token row get the filler ``arange(K) % E``:
    distinct ids, because a row with duplicate ids (e.g. zeros) collapses in the routing map and
    breaks the all-to-all dispatcher's split sizes (it assumes exactly K experts per token);
  * the router sees hidden states ``[s, b, h]`` flattened to ``[s*b, E]``: row = pos * b + batch row
    (sequence-major), so the output is built directly in that order;
  * sequence parallel splits ``s`` contiguously across TP ranks: rank r keeps positions
    ``[r*s/tp, (r+1)*s/tp)``. Without SP every TP rank routes all tokens. EP/ETP do not matter (the
    router runs before dispatch, on the rank's own tokens);
  * context parallel (cp > 1) first gives each CP rank its two load-balanced chunks of ``s``
    (``models.context_parallel.local_positions``: rank r holds chunks r and 2cp-1-r of 2cp), back to
    back; sequence parallelism then splits that local sequence contiguously over TP. Each rank replays
    exactly the routes of its own tokens;
  * only the MoE layers of this pipeline stage (``layers``: global indices, in this rank's router
    order) are kept; dense layers never appear. Expert ids stay logical (megatron has no EPLB remap).

Everything stays in the compact dtype until the per-layer int64 conversion on the device
(``MicroBatchRoutes.layer``), so host memory and host->device traffic are 1-2 bytes per id.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from megatron_s3ac.rollout.base import routed_experts_dtype


def filler(top_k: int, num_experts: int) -> np.ndarray:
    """[top_k] distinct expert ids for rows that carry no rollout routing (pad, last token)."""
    if top_k > num_experts:
        raise ValueError(f"top_k {top_k} > num_experts {num_experts}")
    return np.arange(top_k) % num_experts


def pad_last_row(routes: np.ndarray, num_experts: int) -> np.ndarray:
    """[T-1, L, K] -> [T, L, K]: append the filler row for the last token (never fed forward)."""
    row = np.broadcast_to(filler(routes.shape[2], num_experts).astype(routes.dtype), (1, *routes.shape[1:]))
    return np.concatenate([routes, row], axis=0)


def padded_placements(lengths: Sequence[int]) -> list[tuple[int, int, int]]:
    """Padded batch: sample i in row i from position 0. -> [(row, start, length)]."""
    return [(i, 0, int(n)) for i, n in enumerate(lengths)]


def packed_placements(lengths: Sequence[int]) -> list[tuple[int, int, int]]:
    """Packed row: samples back to back in row 0 (cu_seqlens offsets). -> [(row, start, length)]."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int)
    return [(0, int(a), int(n)) for a, n in zip(starts, lengths)]


def sp_split(config) -> tuple[int, int]:
    """(rank, size) of the sequence split megatron applies before the routers: the TP group when
    ``config.sequence_parallel``, else no split."""
    if not config.sequence_parallel:
        return 0, 1
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def cp_split() -> tuple[int, int]:
    """(rank, size) of this rank's context-parallel group (0, 1 without CP)."""
    from megatron_s3ac.models.context_parallel import cp_group_info

    rank, size, _ = cp_group_info()
    return rank, size


@dataclass
class MicroBatchRoutes:
    """Replay indices of one micro-batch on one rank.

    layers:  global layer index of each column (this rank's MoE layers, all model chunks).
    indices: [len(layers), local_tokens, top_k] compact integer tensor, rows in router order.
    routed:  [local_tokens] bool, True where the row holds the rollout's routes (False: filler rows
             of padding and of each sample's last token); metrics count only these.
    """

    layers: tuple[int, ...]
    indices: torch.Tensor
    routed: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.indices.shape[1]

    def to(self, device) -> "MicroBatchRoutes":
        return MicroBatchRoutes(self.layers, self.indices.to(device, non_blocking=True),
                                self.routed.to(device, non_blocking=True))

    def layer(self, global_layer: int) -> torch.Tensor:
        """[local_tokens, top_k] int64 indices for ``RouterReplay.set_target_indices``."""
        try:
            col = self.layers.index(global_layer)
        except ValueError:
            raise KeyError(f"no routes for layer {global_layer}; this micro-batch has layers {self.layers}") from None
        return self.indices[col].long()


def _check_rows(sel: np.ndarray, num_experts: int, where: str) -> None:
    """Every replayed row must hold top_k distinct ids in [0, num_experts)."""
    if sel.size == 0:
        return
    if int(sel.max()) >= num_experts or int(sel.min()) < 0:
        raise ValueError(f"{where}: expert ids outside [0, {num_experts})")
    k = sel.shape[-1]
    if k <= 16:  # K(K-1)/2 column compares: much cheaper than sorting tiny rows
        dup = any((sel[..., i] == sel[..., j]).any() for i in range(k) for j in range(i + 1, k))
    else:
        srt = np.sort(sel, axis=-1)
        dup = bool((srt[..., 1:] == srt[..., :-1]).any())
    if dup:
        raise ValueError(f"{where}: a (token, MoE layer) row has duplicate expert ids; all-zero MoE rows "
                         "usually mean the engine did not capture that layer (e.g. SGLang pp_size > 1)")


def align_microbatch(routes: Sequence[np.ndarray], placements: Sequence[tuple[int, int, int]],
                     shape: tuple[int, int], layers: Sequence[int], num_experts: int,
                     sp_rank: int = 0, sp_size: int = 1, validate: bool = True,
                     cp_rank: int = 0, cp_size: int = 1) -> MicroBatchRoutes:
    """Build this rank's replay rows for one micro-batch.

    routes:     per sample [T_i - 1, num_layers, top_k] (any integer dtype; kept compact).
    placements: per sample (row, start, length) in ``input_ids [b, s]``; length = T_i or T_i - 1.
    shape:      (b, s) of the micro-batch's input_ids.
    layers:     global indices of this rank's MoE layers (``replay.local_moe_layers``).
    sp_rank, sp_size: the sequence-parallel split (``sp_split(config)``); s must divide by sp_size.
    validate:   check ids are in range and distinct per row (cheap; catches zero-filled captures).
    cp_rank, cp_size: the context-parallel split (``cp_split()``), applied before the SP split.
    Returns MicroBatchRoutes with indices [len(layers), s / cp_size / sp_size * b, top_k],
    routed [s / cp_size / sp_size * b].
    """
    if cp_size > 1:
        from megatron_s3ac.models.context_parallel import local_positions

        b, s = shape
        if (s // cp_size) % sp_size or s % (2 * cp_size):
            raise ValueError(f"sequence length {s} does not split into 2 x cp = {2 * cp_size} chunks with the "
                             f"local part divisible by the sequence-parallel size {sp_size}")
        full = align_microbatch(routes, placements, shape, layers, num_experts, validate=validate)
        n_l, k = full.indices.shape[0], full.indices.shape[2]
        pos = local_positions(s, cp_size, cp_rank)
        s_loc = s // cp_size // sp_size
        keep = pos[sp_rank * s_loc:(sp_rank + 1) * s_loc]
        idx = full.indices.view(n_l, s, b, k)[:, keep].reshape(n_l, s_loc * b, k)
        return MicroBatchRoutes(full.layers, idx.contiguous(), full.routed.view(s, b)[keep].reshape(-1).contiguous())
    if len(routes) != len(placements):
        raise ValueError(f"{len(routes)} samples but {len(placements)} placements")
    b, s = shape
    if s % sp_size:
        raise ValueError(f"sequence length {s} is not divisible by the sequence-parallel size {sp_size}")
    if not routes:
        raise ValueError("a micro-batch without samples has nothing to replay")
    top_k = routes[0].shape[2]
    layers = tuple(int(x) for x in layers)
    s_loc = s // sp_size
    lo, hi = sp_rank * s_loc, (sp_rank + 1) * s_loc
    dtype = routed_experts_dtype(num_experts)
    out = np.empty((len(layers), s_loc, b, top_k), dtype=dtype)
    out[...] = filler(top_k, num_experts).astype(dtype)
    routed = np.zeros((s_loc, b), dtype=bool)
    for i, (r, (row, start, length)) in enumerate(zip(routes, placements)):
        n = r.shape[0]
        if r.ndim != 3 or r.shape[2] != top_k:
            raise ValueError(f"sample {i}: routes must be [rows, num_layers, {top_k}], got {r.shape}")
        if length not in (n, n + 1):
            raise ValueError(f"sample {i}: {length} tokens in the micro-batch but {n} route rows "
                             f"(expected {length - 1} = tokens minus the last, or {length})")
        if not (0 <= row < b and 0 <= start and start + length <= s):
            raise ValueError(f"sample {i}: placement (row={row}, start={start}, length={length}) "
                             f"does not fit input_ids [{b}, {s}]")
        a, z = max(start, lo), min(start + n, hi)  # this sample's routed positions on this SP rank
        if a >= z:
            continue
        sel = np.take(r[a - start:z - start], layers, axis=1)  # [z-a, n_local_layers, K]
        if validate:
            _check_rows(sel, num_experts, f"sample {i}")
        out[:, a - lo:z - lo, row] = sel.transpose(1, 0, 2)
        routed[a - lo:z - lo, row] = True
    return MicroBatchRoutes(layers, torch.from_numpy(out.reshape(len(layers), s_loc * b, top_k)),
                            torch.from_numpy(routed.reshape(-1)))
