"""Checkpoint files load without unpickling arbitrary objects (trainer/run/checkpoint.py ``safe_load``): a file
carrying a pickle payload is refused naming it, before the payload runs; the files the trainer writes load."""
import contextlib
import os
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_s3ac.trainer.run import checkpoint as ck


class _Payload:
    """What a malicious checkpoint carries: unpickling it calls ``open(marker, "w")`` (a visible side effect)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("name", ["trainer_state.pt", "rng_rank0.pt", "rank0.pt"])
def test_pickle_payload_is_refused_naming_the_file(tmp_path, name):
    marker = tmp_path / "payload_ran"
    path = tmp_path / name
    torch.save({"step": 3, "evil": _Payload(str(marker))}, path)
    with pytest.raises(ck.CheckpointFileError, match=rf"{path}: refused to load.*arbitrary code"):
        ck.safe_load(str(path))
    assert not marker.exists()  # the payload never ran


def test_load_checkpoint_refuses_a_poisoned_trainer_state(tmp_path, monkeypatch):
    """The real resume path (models have loaded; then trainer_state.pt) refuses the file, naming it."""
    marker = tmp_path / "payload_ran"
    torch.save({"step": 2, "skipped_steps": 0, "stream": {"epoch": 0, "pos": 0}, "daps": None,
                "x": _Payload(str(marker))}, tmp_path / "trainer_state.pt")
    monkeypatch.setattr(ck, "_models", lambda tr: [])
    tr = SimpleNamespace(models_resident=contextlib.nullcontext)  # what the load touches before trainer_state.pt
    with pytest.raises(ck.CheckpointFileError, match=str(tmp_path / "trainer_state.pt")):
        ck.load_checkpoint(tr, str(tmp_path))
    assert not marker.exists()


def test_not_a_torch_file_is_a_clear_error(tmp_path):
    path = tmp_path / "trainer_state.pt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ck.CheckpointFileError, match=rf"{path}: not a readable torch checkpoint"):
        ck.safe_load(str(path))


def test_rng_files_round_trip_through_the_safe_loader(tmp_path):
    """The plain RNG format restores torch, python and numpy streams exactly; an RNG file of the earlier format
    (numpy's state tuple with its ndarray) still loads."""
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    np.random.standard_normal()  # has_gauss / cached gaussian set
    torch.save(ck._plain_rng(), tmp_path / "rng_rank0.pt")
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
               tmp_path / "rng_old.pt")
    want = (torch.rand(3), random.random(), np.random.standard_normal(4))
    for f in ("rng_rank0.pt", "rng_old.pt"):
        torch.manual_seed(9), random.seed(9), np.random.seed(9)
        ck._restore_rng(ck.safe_load(str(tmp_path / f)))
        got = (torch.rand(3), random.random(), np.random.standard_normal(4))
        assert torch.equal(got[0], want[0]) and got[1] == want[1] and np.array_equal(got[2], want[2]), f


def test_per_rank_optimizer_and_trainer_state_load(tmp_path):
    """What the trainer writes: a torch Adam state dict (rank{r}.pt), the trainer state with DAPS and evaluator."""
    from megatron_s3ac.algorithms.daps import DAPSSampler
    from megatron_s3ac.eval.periodic import PeriodicEvaluator

    p = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.Adam([p], lr=0.1)
    p.sum().backward()
    opt.step()
    torch.save([opt.state_dict()], tmp_path / "rank0.pt")
    (got,) = ck.safe_load(str(tmp_path / "rank0.pt"))
    assert torch.equal(got["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    ev = PeriodicEvaluator({}, every_n_steps=1)
    ev.best_step, ev.best_score, ev.history = 2, np.float64(0.5), [(2, np.float64(0.5))]  # numpy from a report
    daps = DAPSSampler(8)
    state = {"step": 2, "skipped_steps": 0, "stream": {"epoch": 0, "pos": 5}, "daps": daps.state_dict(),
             "evaluator": ev.state_dict()}
    torch.save(state, tmp_path / "trainer_state.pt")
    got = ck.safe_load(str(tmp_path / "trainer_state.pt"))
    assert got["evaluator"] == {"best_step": 2, "best_score": 0.5, "history": [(2, 0.5)]}
    DAPSSampler(8).load_state_dict(got["daps"])
