"""The image inputs of one prompt, as the model's processor returns them (the contract between data rows,
engines, samples and the actor / critic's vision path).

A prompt with images is its token ids, in which every image already stands as ``vision_start``, n x
``image_token_id``, ``vision_end`` (n = grid_t * grid_h * grid_w / merge_size**2 per image, as transformers'
Qwen2-VL / Qwen3.5 processors expand it), plus an ``ImageInputs``: the processor's ``pixel_values``
(flattened patches of all its images in order) and ``image_grid_thw``. Everything a trainer needs to
recompute the engine's inputs travels with the sample; the image bytes themselves do not.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ImageInputs:
    """pixel_values: [N_patches, C * temporal_patch * patch * patch] float32 (all images of the prompt,
    concatenated in order); image_grid_thw: [n_images, 3] int64 (t, h, w in patches).
    ``N_patches == image_grid_thw.prod(-1).sum()``."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor

    def __post_init__(self):
        if self.image_grid_thw.ndim != 2 or self.image_grid_thw.shape[-1] != 3:
            raise ValueError(f"image_grid_thw must be [n_images, 3], got {tuple(self.image_grid_thw.shape)}")
        n = int(self.image_grid_thw.prod(-1).sum())
        if self.pixel_values.ndim != 2 or self.pixel_values.shape[0] != n:
            raise ValueError(f"pixel_values must be [{n}, patch_dim] for grids {self.image_grid_thw.tolist()}, "
                             f"got {tuple(self.pixel_values.shape)}")

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    def num_image_tokens(self, merge_size: int) -> int:
        """Placeholder tokens these images take in the prompt ids."""
        return int(self.image_grid_thw.prod(-1).sum()) // (merge_size * merge_size)

    def state(self) -> dict:
        """Tensors only (``torch.load(weights_only=True)`` reads them back): for checkpoints and queues."""
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw}

    @classmethod
    def from_state(cls, d: dict) -> "ImageInputs":
        return cls(pixel_values=d["pixel_values"], image_grid_thw=d["image_grid_thw"].long())


def concat(items: list["ImageInputs"]) -> "ImageInputs":
    """Several prompts' image inputs as one (rows in order), as a batched vision-tower call takes them."""
    return ImageInputs(torch.cat([i.pixel_values for i in items]), torch.cat([i.image_grid_thw for i in items]))
