"""trainer.step.placement.Placement: a frozen vision tower shared by the actor and the critic (held as a plain
attribute, as models.vision.attach_vision does) leaves the device only once both models' params are off, and comes
back bit-exact as soon as either needs its params, through every phase order the step and the weight sync use."""
import torch
from torch import nn

from megatron_s3ac.models.vision import VISION_ATTR
from megatron_s3ac.trainer.step.placement import Placement, held_towers


class _GPT(nn.Module):
    """What unwrap_gpt recognises as a GPTModel (a ``decoder``), holding ``tower`` outside its parameters."""

    def __init__(self, tower):
        super().__init__()
        self.decoder = nn.Linear(4, 4)
        object.__setattr__(self, VISION_ATTR, tower)


def _placement():
    torch.manual_seed(0)
    tower = nn.Linear(8, 8).requires_grad_(False)
    actor, critic = _GPT(tower), _GPT(tower)
    models = {k: (m, torch.optim.Adam(m.parameters())) for k, m in (("actor", actor), ("critic", critic))}
    return Placement(models, offload_idle=True, colocated=True), tower


def _on_device(tower) -> bool:
    return tower.weight.untyped_storage().nbytes() > 0


def test_shared_tower_follows_the_last_model_holding_it():
    p, tower = _placement()
    assert len(p.towers) == 1 and [n for _, n in p.towers.values()] == [["actor", "critic"]]
    assert held_towers(p.models["actor"][0]) == [tower]
    want = tower.weight.clone()
    m = {}
    p.place(m, off=["actor"])  # the critic's values: the tower stays for the critic's image features
    assert _on_device(tower)
    p.place(m, off=["critic"])  # rollout on a colocated engine: nothing of either model stays
    assert not _on_device(tower) and m["mem/vision_tower_params_gb"] > 0
    p.place(m, on=["critic"])
    assert _on_device(tower) and torch.equal(tower.weight, want)
    p.place(m, on=["actor"], off=["critic"])  # the actor's forward
    assert _on_device(tower)
    # the weight sync's order: the critic and the actor's grads / optimizer off, the actor's params on for the
    # export (the tower stays: the actor's params are on), then the actor's params off too (the tower leaves)
    p.before_engine_wake()
    assert _on_device(tower)
    p.after_weights_loaded()
    assert not _on_device(tower)
    p.place({}, on=["actor", "critic"])
    assert _on_device(tower) and torch.equal(tower.weight, want)


def test_grads_or_optimizer_moves_leave_the_tower_alone():
    p, tower = _placement()
    p.place({}, off=["actor", "critic"], kinds=("grads", "optimizer"))  # params stay on: so does the tower
    assert _on_device(tower)


def test_without_offload_idle_nothing_moves():
    torch.manual_seed(0)
    tower = nn.Linear(8, 8).requires_grad_(False)
    actor = _GPT(tower)
    p = Placement({"actor": (actor, torch.optim.Adam(actor.parameters()))}, offload_idle=False, colocated=True)
    p.place({}, off=["actor"])
    assert _on_device(tower) and actor.decoder.weight.untyped_storage().nbytes() > 0
