"""Qwen3.5's vision path in the actor and the critic: the vision tower, its embeddings scattered into the
megatron decoder input at the image tokens, and the interleaved multimodal rotary positions (mRoPE).

* ``VisionTower``: transformers' ``Qwen3_5MoeVisionModel`` (the HF module itself, so the numerics are
  transformers'), built from the HF ``vision_config`` and the tensors ``model.visual.*`` the checkpoint
  carries (convert/carried.py gathers them over the ranks: no second read of the checkpoint). Replicated on
  every rank of the first pipeline stage. Frozen by default (``train.vision.trainable``): a frozen tower is a
  plain attribute of the model (no parameter of it reaches DDP, the optimizer, the state dict or the weight
  sync); a trainable one is a registered submodule ``vision_tower`` (DDP all-reduces its gradients over DP;
  every TP rank computes the same tower and, through the sequence-parallel scatter's all-gather backward,
  the same gradients), kept out of the megatron state dict: it is saved as the carried ``model.visual.*``
  tensors and exported to the engines under those HF names.
* ``decoder_input``: word embeddings over the whole sequence [b, s, h] (TP all-reduce, not the
  reduce-scatter megatron uses under sequence parallelism), the image embeddings ``masked_scatter``-ed at
  ``image_token_id`` positions in row-major order (transformers' ``Qwen3_5MoeModel.forward``,
  modeling_qwen3_5_moe.py:1723-1731 in 5.24.0), then [s, b, h], this CP rank's chunks, the SP scatter.
* ``mrope_positions``: transformers' ``get_rope_index`` (modeling_qwen3_5_moe.py:1471-1577): text tokens
  count on from the previous group's end on all three axes; an image of llm grid (t, h, w) (h, w divided by
  the spatial merge size) gets T = start + t_idx, H = start + h_idx, W = start + w_idx, and the next group
  starts at start + max(h, w). Right padding continues as text (causal: real positions are unaffected).
* ``InterleavedMRoPE``: the rotary embedding of ``Qwen3_5MoeTextRotaryEmbedding`` (modeling_qwen3_5_moe.py:
  195-218): frequency i takes its position from axis H when i % 3 == 1 and i < 3 * section[1], from W when
  i % 3 == 2 and i < 3 * section[2], else from T (``mrope_interleaved``); [cos | cos] halves as megatron's
  rotate-half ``apply_rotary_pos_emb`` expects. megatron-core 0.19.2's ``MultimodalRotaryEmbedding``
  (models/common/embeddings/rotary_pos_embedding.py:266-367) concatenates contiguous sections instead
  (Qwen2-VL's layout, :356-357) and allocates on CUDA (:305), hence this module. For text (all three axes equal) it equals
  megatron's 1-D ``RotaryEmbedding`` bit for bit.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

from megatron_s3ac.models.multimodal import ImageInputs, concat

VISION_ATTR = "vision_tower"
HF_VISION_PREFIX = "model.visual."


# ---- mRoPE -------------------------------------------------------------------------------------
def mrope_axis(n_freq: int, section: Sequence[int]) -> torch.Tensor:
    """[n_freq] long: the position axis (0 T, 1 H, 2 W) of each rotary frequency, interleaved."""
    i = torch.arange(n_freq)
    axis = torch.zeros(n_freq, dtype=torch.long)
    axis[(i % 3 == 1) & (i < 3 * section[1])] = 1
    axis[(i % 3 == 2) & (i < 3 * section[2])] = 2
    return axis


class InterleavedMRoPE(torch.nn.Module):
    """forward(position_ids [b, s] (text) or [3, b, s], mrope_section, cp_group=None) -> [s, b, 1, rot_dim].

    The positions are this CP rank's already (``models.pipeline`` splits them with the tokens), so no
    CP slicing happens here."""

    def __init__(self, inv_freq: torch.Tensor, mrope_section: Sequence[int]):
        """inv_freq [F]: megatron's ``RotaryEmbedding.inv_freq`` of the model (the same frequencies)."""
        super().__init__()
        self.inv_freq = inv_freq.detach().float().clone()
        n = self.inv_freq.numel()
        if len(mrope_section) != 3 or min(mrope_section) < 0:  # H / W read as transformers does (mrope_axis)
            raise ValueError(f"mrope_section {list(mrope_section)} must be 3 non-negative sections ({n} frequencies)")
        self.axis = mrope_axis(n, mrope_section)

    def forward(self, position_ids: torch.Tensor, mrope_section=None, cp_group=None, **_unused) -> torch.Tensor:
        pos = position_ids
        if pos.ndim == 2:
            pos = pos.unsqueeze(0).expand(3, -1, -1)
        inv = self.inv_freq.to(pos.device)
        freqs = pos[..., None].float() * inv  # [3, b, s, F]
        axis = self.axis.to(pos.device)
        f = torch.gather(freqs, 0, axis.view(1, 1, 1, -1).expand(1, *freqs.shape[1:])).squeeze(0)  # [b, s, F]
        emb = torch.cat((f, f), dim=-1)
        return emb.transpose(0, 1)[:, :, None, :].contiguous()  # [s, b, 1, 2F]


def image_positions(input_ids: torch.Tensor, image_token_id: int,
                    prompt_len: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Bool [b, s]: the image placeholders, i.e. ``image_token_id`` inside each row's prompt (``prompt_len`` [b];
    None: the whole row). A sampled image-token id in a response is text, as the engine decoded it (its
    embedding is the word embedding, its position the next text position: transformers' decode steps use
    ``rope_deltas`` and no pixels)."""
    mask = input_ids == image_token_id
    if prompt_len is not None:
        pl = prompt_len.to(input_ids.device).view(-1, 1)
        mask = mask & (torch.arange(input_ids.shape[1], device=input_ids.device)[None] < pl)
    return mask


def mrope_positions(input_ids: torch.Tensor, images: Sequence[Optional[ImageInputs]], image_token_id: int,
                    spatial_merge_size: int, image_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """input_ids [b, s], one ImageInputs (or None) per row -> position ids [3, b, s] (long). ``image_mask``
    [b, s] (``image_positions``): which tokens are image placeholders (default: every ``image_token_id``)."""
    b, s = input_ids.shape
    out = torch.empty(3, b, s, dtype=torch.long)
    ids = input_ids.cpu()
    img = (ids == image_token_id) if image_mask is None else image_mask.cpu()
    for r in range(b):
        grids = [] if images[r] is None else images[r].image_grid_thw.tolist()
        is_img = img[r].tolist()
        pos, cur, i, g = [], 0, 0, 0
        while i < s:
            j = i
            while j < s and is_img[j] == is_img[i]:
                j += 1
            if not is_img[i]:
                pos.append(torch.arange(j - i).view(1, -1).expand(3, -1) + cur)
                cur += j - i
            else:
                if g >= len(grids):
                    raise ValueError(f"row {r}: more image-token runs than images ({len(grids)})")
                t, h, w = grids[g]
                h, w = h // spatial_merge_size, w // spatial_merge_size
                if t * h * w != j - i:
                    raise ValueError(f"row {r}: image {g} has {j - i} placeholder tokens, its grid {grids[g]} "
                                     f"needs {t * h * w}")
                tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
                pos.append(torch.stack([tt, hh, ww]).reshape(3, -1) + cur)
                cur += max(h, w)
                g += 1
            i = j
        if g != len(grids):
            raise ValueError(f"row {r}: {len(grids)} images but {g} image-token runs")
        out[:, r] = torch.cat(pos, dim=1)
    return out.to(input_ids.device)


# ---- the vision tower ----------------------------------------------------------------------------
class VisionTower(torch.nn.Module):
    """transformers' Qwen3.5 vision model. forward(ImageInputs) -> image embeddings [n_tokens, out_hidden]
    (all images in order; n_tokens = sum(t h w) / merge**2)."""

    def __init__(self, vision_config: dict, tensors: dict[str, torch.Tensor], dtype=torch.float32):
        super().__init__()
        from transformers import Qwen3_5MoeVisionConfig
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

        cfg = Qwen3_5MoeVisionConfig(**{k: v for k, v in vision_config.items() if k != "model_type"})
        self.model = Qwen3_5MoeVisionModel(cfg).eval()
        missing = sorted(set(self.model.state_dict()) - set(tensors))
        extra = sorted(set(tensors) - set(self.model.state_dict()))
        if missing or extra:
            raise ValueError(f"vision tower tensors do not match the vision_config: missing {missing[:4]}, "
                             f"unexpected {extra[:4]}")
        self.model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()})
        self.model.to(dtype)
        self.merge = cfg.spatial_merge_size

    def forward(self, images: ImageInputs) -> torch.Tensor:
        p = next(self.model.parameters())
        out = self.model(images.pixel_values.to(p.device, p.dtype), grid_thw=images.image_grid_thw.to(p.device))
        return out.pooler_output

    def hf_named_parameters(self):
        """(HF name ``model.visual.<name>``, parameter) of every tensor."""
        for n, p in self.model.named_parameters():
            yield HF_VISION_PREFIX + n, p


def attach_vision(gpt, tower: VisionTower, trainable: bool, image_token_id: int) -> None:
    """Give a GPTModel (the actor, or a critic's backbone) its vision tower (held on the first pipeline
    stage only; every stage learns the image token id and merge size, which the mRoPE positions need)."""
    gpt.s3ac_vision_meta = (int(image_token_id), int(tower.merge))
    if not gpt.pre_process:
        object.__setattr__(gpt, "s3ac_vision_spare", tower)  # unused here; a critic at another layout may need it
        return
    for p in tower.parameters():
        p.requires_grad_(trainable)
    if trainable:
        gpt.add_module(VISION_ATTR, tower)
        # the megatron checkpoint keeps the tower as carried ``model.visual.*`` tensors, not module keys
        gpt.register_load_state_dict_post_hook(_ignore_vision_keys)
        tower.sharded_state_dict = lambda *a, **k: {}
    else:
        object.__setattr__(gpt, VISION_ATTR, tower)  # not a submodule: no parameter of it is trained or saved
        tower.train(False)


def _ignore_vision_keys(module, incompatible):
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if not k.startswith(VISION_ATTR + ".")]


def unwrap_gpt(model):
    """The GPTModel inside DDP / Float16Module / Critic wrappers."""
    m = model
    for _ in range(4):
        if hasattr(m, "embedding") or hasattr(m, "decoder"):
            return m
        m = getattr(m, "module", m)
    return m


def vision_of(model, spare: bool = False) -> Optional[VisionTower]:
    """The model's vision tower (frozen or trainable), None without one; ``spare``: also the copy a later
    pipeline stage keeps unused."""
    gpt = unwrap_gpt(model)
    for t in (gpt.__dict__.get(VISION_ATTR), gpt._modules.get(VISION_ATTR),
              gpt.__dict__.get("s3ac_vision_spare") if spare else None):
        if t is not None:
            return t
    return None


def vision_meta(model) -> Optional[tuple[int, int]]:
    """(image_token_id, spatial_merge_size) of a model with a vision path, else None."""
    return getattr(unwrap_gpt(model), "s3ac_vision_meta", None)


def model_inputs(model, batch, ids: torch.Tensor):
    """(position_ids [3, b, s], decoder_input) of a micro-batch with images, None when it has none."""
    images = batch.get("images")
    if images is None or all(im is None for im in images):
        return None
    meta = vision_meta(model)
    if meta is None:
        raise ValueError("a micro-batch has images but the model has no vision path (text-only checkpoint?)")
    if batch.get("position_ids") is not None:
        raise ValueError("packed micro-batches with images are not supported (the mRoPE positions restart per "
                         "image prompt); use padded micro-batches (algo.max_tokens_per_micro_batch: 0)")
    # placeholders only inside the prompts: a response's sampled image-token id stays text (image_positions)
    mask = image_positions(ids, meta[0], batch.get("prompt_len"))
    return mrope_positions(ids, images, *meta, image_mask=mask), decoder_input(model, ids, images, mask)


@contextlib.contextmanager
def _all_reduced_embeddings(word_embeddings):
    old = word_embeddings.reduce_scatter_embeddings
    word_embeddings.reduce_scatter_embeddings = False
    try:
        yield
    finally:
        word_embeddings.reduce_scatter_embeddings = old


def decoder_input(model, input_ids: torch.Tensor, images: Sequence[Optional[ImageInputs]],
                  image_mask: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """The decoder input [s(/cp)(/tp under SP), b, h] of a micro-batch with images: word embeddings with the
    vision tower's output at the image tokens (``image_mask`` [b, s], default every ``image_token_id``).
    None on a stage without embeddings (PP > first)."""
    from megatron.core import tensor_parallel

    from megatron_s3ac.models.context_parallel import cp_group_info, split_for_cp

    gpt = unwrap_gpt(model)
    if not gpt.pre_process:
        return None
    tower = vision_of(gpt)
    if tower is None:
        raise ValueError("a micro-batch has images but the model has no vision tower (a text-only checkpoint, "
                         "or the checkpoint's model.visual.* tensors were not carried)")
    emb_mod = gpt.embedding
    with _all_reduced_embeddings(emb_mod.word_embeddings):
        emb = emb_mod.word_embeddings(input_ids)  # [b, s, h], whole sequence
    present = [im for im in images if im is not None]
    mask = (input_ids == gpt.s3ac_vision_meta[0]) if image_mask is None else image_mask.to(input_ids.device)
    if present:
        feats = tower(concat(present)).to(emb.dtype)
        if int(mask.sum()) != feats.shape[0]:
            raise ValueError(f"{int(mask.sum())} image tokens in the micro-batch, the vision tower gave "
                             f"{feats.shape[0]} embeddings")
        emb = emb.masked_scatter(mask[..., None], feats)
    elif bool(mask.any()):
        raise ValueError("image tokens in a micro-batch without images")
    emb = emb.transpose(0, 1).contiguous()  # [s, b, h]
    if gpt.config.fp32_residual_connection:
        emb = emb.float()
    _, cp, _ = cp_group_info()
    if cp > 1:
        emb = split_for_cp(emb, 0)
    if gpt.config.sequence_parallel:
        emb = tensor_parallel.scatter_to_sequence_parallel_region(emb)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            emb = emb_mod.embedding_dropout(emb)
    else:
        emb = emb_mod.embedding_dropout(emb)
    return emb
