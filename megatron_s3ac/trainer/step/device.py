"""The one place that says where a step's tensors live."""
from __future__ import annotations

import torch


def trainer_device() -> torch.device:
    """This rank's CUDA device when the trainer runs on CUDA (``models.parallel.init_distributed``
    then picks NCCL and sets the device from LOCAL_RANK), else the host (gloo). The models, every batch
    and micro-batch of a step and every tensor handed to a collective live here: NCCL only takes CUDA
    tensors, gloo only host ones."""
    from megatron_s3ac.models.cpu_compat import cuda_available

    return torch.device("cuda", torch.cuda.current_device()) if cuda_available() else torch.device("cpu")
