"""The trainer's weight path into a vLLM engine on CPU: one weight-update session around the rank-0 sync.

Every trainer rank builds a ``VLLMSessionSync`` (rank 0 passes the engine, the others None) and calls ``sync``:

1. rank 0 checks every tensor the export will send (the converter's plan: names, shapes) against the engine's
   served checkpoint and opens the engine's session; the verdict reaches every rank, so a refusal stops all of them
   before the first bucket moves;
2. ``rollout.weight_sync.sync_weights``: each stage's leader hands its buckets to rank 0 (shared memory on one
   host), rank 0 broadcasts each into the open session over the engine's gloo group (``VLLMEngine.send_bucket``);
3. rank 0 finishes the session: the engine commits the staged tensors, reloads, flushes its prefix cache. A
   failure before the finish aborts the session: the engine keeps the weights it had (all or nothing).

The same shape as ``rollout.sync_strategy``'s strategies (``sync`` / ``sleep`` / ``close`` / ``close_engine``), so
it registers there as the (vllm, colocated) and (vllm, separate) path on CPU. The GPU paths (NCCL per stage, IPC
colocated) are ``rollout.vllm_gpu``.
"""
from __future__ import annotations

import torch.distributed as dist


class VLLMSessionSync:
    sleeps = False  # vLLM's CPU worker ignores sleep (v1/worker/cpu_worker.py:179-184)
    shuts_down_engine = True

    def __init__(self, engine=None, *, settings=None, quantize=None):
        if quantize is not None:
            raise ValueError("rollout.weights_dtype: fp8 is not wired for rollout.engine=vllm on CPU (the served "
                             "checkpoint has no *_scale_inv tensors); use bf16")
        self.engine, self.settings, self.quantize = engine, settings, quantize
        self._planned = None
        self.version = 0

    def _open(self, info) -> None:
        """Every rank: rank 0 checks the whole export and opens the session; its verdict reaches every rank."""
        from megatron_s3ac.rollout.broadcast import planned_weights

        error = None
        if self.engine is not None:
            try:
                if self._planned is None or self._planned[0] is not info:
                    self._planned = (info, planned_weights(info))
                names, shapes = self._planned[1]
                self.engine.check_weights(names, shapes, "weight sync")
                self.engine.begin_weight_update()
            except BaseException as err:  # noqa: BLE001 - re-raised below, after every rank heard of it
                error = err
        box = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(box, src=self._controller())
        if error is not None:
            raise error
        if box[0] is not None:
            raise RuntimeError(f"rank {dist.get_rank()}: the rank driving the vLLM engine refused the weight sync "
                               f"before it started: {box[0]}")

    def _controller(self) -> int:
        if getattr(self, "_ctl", None) is None:
            flags = [None] * dist.get_world_size()
            dist.all_gather_object(flags, self.engine is not None)
            held = [r for r, f in enumerate(flags) if f]
            if len(held) != 1:
                raise ValueError(f"VLLMSessionSync needs exactly one rank holding the engine; ranks {held} do")
            self._ctl = held[0]
        return self._ctl

    def sync(self, chunks, info):
        from megatron_s3ac.rollout.weight_sync import sync_weights

        self._open(info)
        bucket = self.settings.bucket_bytes if self.settings is not None else 256 << 20
        try:
            stats = sync_weights(chunks, info, self.engine, bucket_bytes=bucket)
        except BaseException:
            if self.engine is not None:
                self.engine._abort_quietly()
            raise
        if self.engine is not None:
            self.version += 1
            self.engine.finish_weight_update(weight_version=str(self.version))
        return stats

    def sleep(self) -> None:
        if self.sleeps and self.engine is not None:
            self.engine.sleep()

    def close(self) -> None:
        """Nothing to leave: the gloo group goes with the engine."""

    def close_engine(self) -> bool:
        if self.engine is None:
            return False
        self.engine.shutdown()
        self.engine = None
        return True
