"""Keep the caller's random streams where they were: evaluation must not shift training's RNG.

Evaluation samples with its own seeds (SamplingParams.seed, per-call generators), but an engine or
library may still draw from a global stream; saving and restoring every global state around it
makes "a run with eval == the same run without eval" hold regardless.
"""
from __future__ import annotations

import contextlib
import random

import numpy as np
import torch


@contextlib.contextmanager
def preserved_rng_state():
    """Restore python `random`, numpy's global RNG, torch's CPU RNG and (if initialised) every
    CUDA device's RNG on exit, also when the body raises."""
    py_state = random.getstate()
    np_state = np.random.get_state()
    torch_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
