"""Drive megatron-core's RouterReplay through one ``forward_backward`` call.

megatron-core 0.19.2 gives every ``TopKRouter`` a ``RouterReplay`` when
``moe_enable_routing_replay=True`` (transformer/moe/router.py:255-257). Its action decides where the top-k indices come from:
  REPLAY_FORWARD   ``target_topk_idx`` (the latest ``set_target_indices``),
  REPLAY_BACKWARD  pop the oldest entry of ``replay_backward_list`` (``set_target_indices``
                   also appends there), used when activation recomputation re-runs the router
                   during backward,
  RECORD / None    the router's own top-k.
Only the *indices* are replayed: the gate values are the training logits gathered at them (softmax
over the selected k), so the router still gets a gradient.

``routing_replay(model_chunks, routes)`` installs, on each model chunk, a forward pre-hook that
takes the chunk's next micro-batch of routes, hands every local MoE router its layer's indices and
sets REPLAY_FORWARD, and a forward post-hook that sets REPLAY_BACKWARD. Megatron's schedules run
forwards of one chunk in micro-batch order and, per chunk, backwards in the same order as the
forwards (1F1B, interleaved, no-pipelining alike), so the FIFO of each router pops exactly the
micro-batch whose backward (and recompute) is running. A recompute happens inside backward, where
the chunk's last post-hook has left REPLAY_BACKWARD on. On exit every router's queue and action are
cleared, so each pass (old log-probs, each update mini-batch) starts empty.

Routers are found by walking the chunks (not ``RouterReplay.global_router_replay_instances``, which
is process-global and also holds the routers of any other model built in the process). A router's
global layer index is ``router.layer_number - 1`` (set by TransformerLayer with the PP offset).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from megatron_s3ac.r3.align import MicroBatchRoutes
from megatron_s3ac.r3.config import R3ConfigError, check_replay_config


def chunk_routers(model_chunk: torch.nn.Module) -> list[tuple[int, TopKRouter]]:
    """(global layer index, router) of every MoE layer in ``model_chunk``, in build order."""
    return [(int(m.layer_number) - 1, m) for m in model_chunk.modules() if isinstance(m, TopKRouter)]


def local_moe_layers(model_chunks: Sequence[torch.nn.Module]) -> list[int]:
    """Global indices of this rank's MoE layers over all its model chunks: what ``align`` keeps."""
    return [layer for chunk in model_chunks for layer, _ in chunk_routers(chunk)]


def _replay_routers(model_chunks) -> list[list[tuple[int, TopKRouter]]]:
    per_chunk = [chunk_routers(c) for c in model_chunks]
    routers = [r for rs in per_chunk for _, r in rs]
    if not routers:
        raise R3ConfigError("routing replay: the model has no MoE router on this rank")
    check_replay_config(routers[0].config)
    return per_chunk


def _clear(per_chunk) -> None:
    for routers in per_chunk:
        for _, router in routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()


def _input_ids(args, kwargs):
    ids = args[0] if args else kwargs.get("input_ids")
    return ids if torch.is_tensor(ids) else None


@contextmanager
def routing_replay(model_chunks: Sequence[torch.nn.Module],
                   routes: Sequence[MicroBatchRoutes]) -> Iterator[None]:
    """Replay ``routes[i]`` in the forward (and any recompute) of micro-batch i of every chunk.

    model_chunks: the modules the schedule calls (DDP-wrapped is fine), one per VPP chunk.
    routes:       one MicroBatchRoutes per micro-batch, in the order given to ``forward_backward``,
                  covering ``local_moe_layers(model_chunks)``.
    Use around exactly one ``forward_backward`` call (forward-only or not)::

        with routing_replay(chunks, routes):
            forward_backward(chunks, microbatches, loss_fn, forward_only)
    """
    per_chunk = _replay_routers(model_chunks)
    config = next(router for rs in per_chunk for _, router in rs).config
    sp_size = config.tensor_model_parallel_size if config.sequence_parallel else 1
    cursors = [0] * len(model_chunks)
    handles = []

    def pre_hook(c):
        def hook(module, args, kwargs):
            if not per_chunk[c]:
                return
            i = cursors[c]
            if i >= len(routes):
                raise RuntimeError(f"routing replay: chunk {c} runs forward #{i + 1} but routes were "
                                   f"given for {len(routes)} micro-batches")
            cursors[c] += 1
            device = per_chunk[c][0][1].weight.device
            mb = routes[i].to(device)
            ids = _input_ids(args, kwargs)
            if ids is not None and ids.numel() // sp_size != mb.num_tokens:
                raise ValueError(f"routing replay: micro-batch {i} has {ids.numel()} tokens "
                                 f"({ids.numel() // sp_size} per SP rank) but its routes have {mb.num_tokens} rows")
            for layer, router in per_chunk[c]:
                router.router_replay.set_target_indices(mb.layer(layer))
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        return hook

    def post_hook(c):
        def hook(module, args, output):
            # Recompute re-runs this chunk's routers inside its backward: pop the FIFO there.
            for _, router in per_chunk[c]:
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        return hook

    _clear(per_chunk)
    try:
        for c, chunk in enumerate(model_chunks):
            handles.append(chunk.register_forward_pre_hook(pre_hook(c), with_kwargs=True))
            handles.append(chunk.register_forward_hook(post_hook(c)))
        yield
        for c in range(len(model_chunks)):
            if per_chunk[c] and cursors[c] != len(routes):
                raise RuntimeError(f"routing replay: routes for {len(routes)} micro-batches, but chunk {c} "
                                   f"ran {cursors[c]} forwards")
    finally:
        for h in handles:
            h.remove()
        _clear(per_chunk)
