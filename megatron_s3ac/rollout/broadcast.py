"""Separate-GPU weight sync, trainer side: ``init_weights_update_group`` + broadcast, bucket by bucket.

sglang's engine side (0.5.23, model_executor/model_runner_components/weight_updater.py:100-144, 260-310): each
engine TP rank joins a torch.distributed group of ``world_size`` = 1 + sum of the engines' TP sizes as rank
``rank_offset + tp_rank`` (the trainer's sender is rank 0), through ``init_custom_process_group``
(utils/common.py:2859-2925: rendezvous on ``init_method``, a PrefixStore named after the group, a group outside
the default world). For each bucket the engine allocates the tensors and receives them with
``broadcast(src=0)``: one broadcast per tensor, or one of the whole flat uint8 bucket with
``load_format="flattened_bucket"`` (weight_sync/tensor_bucket.py:86-112: tensors back to back, no padding, each
starting at a multiple of its element size).

``WeightBroadcaster`` is that rank 0: it asks every engine to join (asynchronously: joining blocks until all
members have), joins itself, then per bucket asks every engine to receive and broadcasts the flat bucket.
The engines must be inside a weight-update session (``EnginePool.begin_weight_update`` / ``finish_sync``),
opened once around the whole sync. The bytes come from the rank that owns them: with pipeline parallelism each
stage leader runs its own broadcaster (group ``<name>-pp<stage>``) over the stage's exported buckets, taking
turns in stage order, so nothing is gathered through one rank.
"""
from __future__ import annotations

import datetime
import socket
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout: Optional[datetime.timedelta] = None):
    """A process group independent of the default one (which may not exist), the way sglang's engine creates its
    side (utils/common.py:2859-2925), so both sides rendezvous on the same store keys. Blocks until all join."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timeout or datetime.timedelta(minutes=10)
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def flat_bucket(bucket: Sequence[tuple[str, torch.Tensor]], device: torch.device):
    """(names, dtype names, shapes, flat uint8 tensor on device) in sglang's flattened-bucket layout. Tensors are
    ordered by decreasing element size so each starts aligned (the receiver refuses unaligned offsets)."""
    order = sorted(bucket, key=lambda nt: -nt[1].element_size())
    names, dtypes, shapes, parts = [], [], [], []
    for name, t in order:
        t = t.detach().contiguous()
        names.append(name)
        dtypes.append(str(t.dtype).removeprefix("torch."))
        shapes.append(list(t.shape))
        parts.append(t.reshape(-1).view(torch.uint8).to(device))
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    return names, dtypes, shapes, flat


class WeightBroadcaster:
    """Rank 0 of a weight-update group with the engines of ``pool`` (an EnginePool: its ``submit``/``wait``
    run engine methods asynchronously, errors name the engine).

    backend: "nccl" on GPUs (engine TP ranks receive on their GPUs), "gloo" on CPU (tests).
    """

    def __init__(self, pool, group_name: str = "s3ac-weights", master_address: Optional[str] = None,
                 master_port: Optional[int] = None, backend: str = "nccl", device: Optional[torch.device] = None,
                 timeout_s: float = 600.0):
        self.pool, self.group_name, self.backend = pool, group_name, backend
        self.master_address = master_address or socket.gethostbyname(socket.gethostname())
        self.master_port = int(master_port or free_port())
        self.device = device or (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                                 else torch.device("cpu"))
        self.timeout_s = float(timeout_s)
        self.group = None
        self.tp_sizes = list(pool.tp_sizes)
        self.world_size = 1 + sum(self.tp_sizes)

    def connect(self) -> None:
        """Every engine joins (rank_offset = 1 + TP ranks of the engines before it), then this rank; both sides
        block until the group is complete, hence the asynchronous engine calls."""
        offsets = [1 + sum(self.tp_sizes[:i]) for i in range(len(self.tp_sizes))]
        refs = [self.pool.submit(i, "init_weights_update_group", self.master_address, self.master_port, off,
                                 self.world_size, self.group_name, self.backend)
                for i, off in enumerate(offsets)]
        self.group = init_custom_process_group(self.backend, f"tcp://{self.master_address}:{self.master_port}",
                                               self.world_size, 0, self.group_name,
                                               timeout=datetime.timedelta(seconds=self.timeout_s))
        self.pool.wait(refs, "init_weights_update_group", self.timeout_s)

    def send(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]]) -> dict:
        """Broadcast each bucket (engines inside a session). Returns {"tensors", "bytes", "buckets", "names"}."""
        if self.group is None:
            raise RuntimeError("WeightBroadcaster.connect() first")
        stats = {"tensors": 0, "bytes": 0, "buckets": 0, "names": []}
        for bucket in buckets:
            if not bucket:
                continue
            names, dtypes, shapes, flat = flat_bucket(bucket, self.device)
            # names/shapes against each served checkpoint first: sglang would skip unknown names silently
            self.pool.wait([self.pool.submit(i, "check_weights", names, shapes) for i in range(len(self.tp_sizes))],
                           "check_weights", self.timeout_s)
            refs = [self.pool.submit(i, "update_weights_from_distributed", names, dtypes, shapes, self.group_name)
                    for i in range(len(self.tp_sizes))]
            work = dist.broadcast(flat, src=0, group=self.group, async_op=True)
            self.pool.wait(refs, f"update_weights_from_distributed (bucket {stats['buckets']}: {names[0]} ..)",
                           self.timeout_s)
            work.wait()
            stats["tensors"] += len(names)
            stats["bytes"] += int(flat.numel())
            stats["buckets"] += 1
            stats["names"].extend(names)
        return stats

    def close(self) -> None:
        if self.group is None:
            return
        refs = [self.pool.submit(i, "destroy_weights_update_group", self.group_name) for i in range(len(self.tp_sizes))]
        dist.destroy_process_group(self.group)
        self.group = None
        self.pool.wait(refs, "destroy_weights_update_group", self.timeout_s)
