"""Carried tensors (the vision tower, the MTP head) through training checkpoints, at any layout.

A converted checkpoint stores each carried HF tensor as the global tensor ``s3ac_carried.<HF name>``, in
the row blocks of ``plan.carried_chunks`` (plan.py). The megatron model has no module for them, so the
actor holds them as plain extra state, ``model.s3ac_carried`` (a ``CarriedTensors``, not a module: no
parameter, no gradient, never on the trainer's device, never exported by the weight sync):

* ``load_model(model, dir)`` loads the model *and* the carried blocks in one ``dist_checkpointing.load``
  (collective); each rank takes a share of the blocks (``assign``: greedy by bytes over the world, the
  same on every rank), so a rank holds about 1/world of the carried bytes, in CPU memory;
* ``model_sharded_state_dict(model)`` is ``model.sharded_state_dict()`` plus those blocks as
  ``ShardedTensor``s (replica 0, regular grid along dim 0), so every ``dist_checkpointing.save`` of the
  actor writes them again: the checkpoint loads at any TP / PP / EP / ETP and world size (a block is a
  region of a layout-free global tensor) and ``mcore-to-hf`` of it writes the complete HF model.

A checkpoint without carried tensors leaves what the model already holds (e.g. those loaded from
``model.actor_init``): they are frozen, so any copy is the one to keep.
"""
from __future__ import annotations

import math

import torch

from megatron_s3ac.convert.dcp_io import DistcpCheckpoint
from megatron_s3ac.convert.plan import CARRIED_KEY_PREFIX, is_carried_key

ATTR = "s3ac_carried"


def assign(blocks: list[tuple[str, tuple, tuple, int]], world: int) -> list[list[int]]:
    """Indices of ``blocks`` [(key, offset, shape, nbytes)] per rank: largest first to the least loaded
    rank (ties: lowest rank), a deterministic function of the list and ``world``."""
    loads, out = [0] * world, [[] for _ in range(world)]
    for i in sorted(range(len(blocks)), key=lambda i: (-blocks[i][3], blocks[i][0], blocks[i][1])):
        r = loads.index(min(loads))
        loads[r] += blocks[i][3]
        out[r].append(i)
    return out


class CarriedTensors:
    """This rank's blocks of a checkpoint's carried tensors: ``{(key, offset): tensor}`` (CPU)."""

    def __init__(self, global_shapes: dict[str, tuple], blocks: dict[tuple, torch.Tensor],
                 dtypes: dict[str, torch.dtype] | None = None):
        self.global_shapes = global_shapes
        self.blocks = blocks
        self.dtypes = dtypes or {k: t.dtype for (k, _), t in blocks.items()}

    @classmethod
    def layout(cls, ckpt_dir: str, rank: int, world: int) -> "CarriedTensors | None":
        """Empty (uninitialised) blocks for this rank's share of ``ckpt_dir``'s carried tensors; None when
        the checkpoint has none. Reads only ``.metadata``."""
        ck = DistcpCheckpoint(ckpt_dir)
        try:
            shapes, blocks, dtypes = {}, [], {}
            for key, md in ck.md.state_dict_metadata.items():
                if not (is_carried_key(key) and ck.has(key)):
                    continue
                shapes[key] = tuple(md.size)
                dtypes[key] = ck.dtype(key)
                item = ck.dtype_name(key).itemsize
                for c in md.chunks:
                    blocks.append((key, tuple(c.offsets), tuple(c.sizes), math.prod(c.sizes) * item))
            if not blocks:
                return None
            mine = assign(blocks, world)[rank]
            data = {(blocks[i][0], blocks[i][1]): torch.empty(blocks[i][2], dtype=ck.dtype(blocks[i][0]))
                    for i in sorted(mine)}
            return cls(shapes, data, dtypes)
        finally:
            ck.close()

    def sharded_state_dict(self) -> dict:
        """``{"<key>@<offset>": ShardedTensor}`` for this rank's blocks (dim-0 blocks of equal size)."""
        from megatron.core.dist_checkpointing import ShardedTensor

        out = {}
        for (key, off), t in self.blocks.items():
            gshape = self.global_shapes[key]
            frag = (gshape[0] // t.shape[0], *([1] * (len(gshape) - 1)))
            out[f"{key}@{'.'.join(map(str, off))}"] = ShardedTensor(
                key=key, data=t, dtype=t.dtype, local_shape=tuple(t.shape), global_shape=gshape,
                global_offset=off, axis_fragmentations=frag, replica_id=0)
        return out

    def take(self, loaded: dict) -> dict:
        """Move this rank's blocks out of a ``dist_checkpointing.load`` result; returns the rest."""
        rest = dict(loaded)
        for (key, off) in list(self.blocks):
            self.blocks[(key, off)] = rest.pop(f"{key}@{'.'.join(map(str, off))}")
        return rest

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.blocks.values())


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def model_sharded_state_dict(model) -> dict:
    """``model.sharded_state_dict()`` plus the carried blocks it holds (none: the same dict). A trainable
    vision tower's current weights are copied into its carried blocks first, so the checkpoint has them."""
    sd = model.sharded_state_dict()
    carried = getattr(model, ATTR, None)
    if carried is not None:
        refresh_from_vision(model)
        sd.update(carried.sharded_state_dict())
    return sd


def full_tensors(model, hf_prefix: str) -> dict[str, torch.Tensor]:
    """``{HF name: whole tensor}`` of the carried tensors under ``hf_prefix`` (e.g. ``model.visual.``), on every
    rank: each rank contributes its blocks, one all-reduce (sum) per tensor over the world (every block is held
    by exactly one rank). Collective; {} when the model carries none."""
    import torch.distributed as dist

    carried = getattr(model, ATTR, None)
    if carried is None:
        return {}
    key_prefix = CARRIED_KEY_PREFIX + hf_prefix
    out = {}
    for key in sorted(k for k in carried.global_shapes if k.startswith(key_prefix)):  # same list on every rank
        full = torch.zeros(carried.global_shapes[key], dtype=carried.dtypes[key])
        for (k, off), t in carried.blocks.items():
            if k == key:
                full[tuple(slice(o, o + n) for o, n in zip(off, t.shape))] = t
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(full)
        out[key[len(CARRIED_KEY_PREFIX):]] = full
    return out


def attach_vision_from_carried(model, info, trainable: bool = False, dtype=torch.float32) -> bool:
    """Build the model's vision tower (models/vision.py) from the ``model.visual.*`` tensors it carries and
    attach it (collective). False (nothing attached) for a model without a vision config or carried tower."""
    from megatron_s3ac.models.vision import HF_VISION_PREFIX, VisionTower, attach_vision

    hf = info.hf
    if not isinstance(hf.get("vision_config"), dict):
        return False
    tensors = full_tensors(model, HF_VISION_PREFIX)
    if not tensors:
        return False
    tower = VisionTower(hf["vision_config"], {k[len(HF_VISION_PREFIX):]: v for k, v in tensors.items()}, dtype)
    dev = next(model.parameters()).device
    attach_vision(model, tower.to(dev), trainable, image_token_id=int(hf.get("image_token_id", 248056)))
    return True


@torch.no_grad()
def refresh_from_vision(model) -> None:
    """Copy a trainable vision tower's weights into this rank's carried blocks of ``model.visual.*``."""
    tower = _trainable_tower(model)
    carried = getattr(model, ATTR, None)
    if tower is None or carried is None:
        return
    params = {CARRIED_KEY_PREFIX + n: p for n, p in tower.hf_named_parameters()}
    for (key, off), t in carried.blocks.items():
        p = params.get(key)
        if p is not None:
            t.copy_(p.detach()[tuple(slice(o, o + n) for o, n in zip(off, t.shape))].to(t.dtype).cpu())


def _trainable_tower(model):
    """The vision tower registered as a module of the GPTModel (trainable; a frozen one is not a module), or None."""
    from megatron_s3ac.models.vision import VISION_ATTR, unwrap_gpt

    for m in (model, unwrap_gpt(model)):
        tower = m._modules.get(VISION_ATTR) if hasattr(m, "_modules") else None
        if tower is not None:
            return tower
    return None


def optimizer_model_state_dict(model) -> dict:
    """The model state dict an optimizer's ``sharded_state_dict`` maps its parameters through:
    ``model.sharded_state_dict()`` plus a trainable vision tower's parameters as replicated ShardedTensors
    (``s3ac_vision.<HF name>``, each the parameter itself). The tower's weights are saved as carried blocks, so the
    model's own state dict has no entry for them, and megatron's distributed optimizer refuses a parameter it
    cannot find there ("... not in model_sharded_state_dict"); its Adam states are then saved under those keys."""
    from megatron.core.utils import make_sharded_tensor_for_checkpoint

    sd = model.sharded_state_dict()
    tower = _trainable_tower(model)
    if tower is not None:
        for n, p in tower.hf_named_parameters():
            key = "s3ac_vision." + n
            sd[key] = make_sharded_tensor_for_checkpoint(p, key)
    return sd


def load_model(model, ckpt_dir: str) -> None:
    """``model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir))`` that also
    loads this rank's share of the checkpoint's carried tensors into ``model.s3ac_carried`` (collective)."""
    from megatron.core import dist_checkpointing

    carried = CarriedTensors.layout(ckpt_dir, *_rank_world())
    sd = model.sharded_state_dict()
    if carried is not None:
        sd.update(carried.sharded_state_dict())
    loaded = dist_checkpointing.load(sd, ckpt_dir)
    if carried is not None:
        loaded = carried.take(loaded)
        setattr(model, ATTR, carried)  # a plain attribute: not a module, parameter or buffer
    model.load_state_dict(loaded)
    if carried is not None:
        _vision_from_carried(model)


@torch.no_grad()
def _vision_from_carried(model) -> None:
    """After a load: the model's vision tower (built earlier from ``model.actor_init``'s carried tensors) takes the
    checkpoint's ``model.visual.*``: a tower trained before the save resumes trained, not as initialised.
    Collective (``full_tensors``) on every rank of a model with a vision path (``s3ac_vision_meta``, set on every
    pipeline stage by ``attach_vision``), the same decision everywhere."""
    from megatron_s3ac.models.vision import HF_VISION_PREFIX, unwrap_gpt, vision_of

    if getattr(unwrap_gpt(model), "s3ac_vision_meta", None) is None:
        return
    tensors = full_tensors(model, HF_VISION_PREFIX)
    tower = vision_of(model, spare=True)
    if tower is None or not tensors:
        return
    for n, p in tower.hf_named_parameters():
        if n in tensors:
            p.copy_(tensors[n].to(p.dtype))
