"""Issue 27's "Must show": RL steps with image prompts on the CPU engine (loaded multimodal because the data has
images), 2 gloo ranks (TP1 x EP2), the tiny Qwen3.5-MoE VL miniature (examples/cpu_demo_vl.yaml, its HF dir
converted with hf_to_mcore into model.actor_init). Checked against independent references: the routers' own
top-k (no replay) against the engine's recorded routes over every position, image placeholders included
(r3/agreement == 1.0); the vision tower's weights before / after the steps (frozen: bit-equal and never in a
weight-sync bucket; ``train.vision.trainable``: changed, sent as model.visual.*, and the engine's tower equal
to the trainer's after the sync)."""
import os

import pytest
import torch

from megatron_s3ac.testing.dist import run_distributed
from megatron_s3ac.trainer.config import load_config

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.fixture(scope="module")
def miniature(tmp_path_factory):
    from megatron_s3ac.convert import hf_to_mcore
    from megatron_s3ac.trainer.tasks_vision import save_vision_miniature

    root = tmp_path_factory.mktemp("rl_images")
    paths = save_vision_miniature(str(root / "data"), num_prompts=8, eval_prompts=2)
    mcore = str(root / "mcore")
    hf_to_mcore(paths["model"], mcore, progress=False)
    return paths, mcore


def _rl_steps(paths, mcore, out_dir, trainable, steps):
    import numpy as np

    from megatron_s3ac.models.vision import vision_of
    from megatron_s3ac.trainer.loop import Trainer
    from tests.trainer.test_trainer import capture_batches

    m = paths["model"]
    cfg = load_config(os.path.join(ROOT, "examples", "cpu_demo_vl.yaml"), [
        f"model.hf_config={m}", f"model.engine_hf_dir={m}", f"model.actor_init={mcore}", f"data.path={paths['train']}",
        f"train.out_dir={out_dir}", f"eval.benchmarks.heldout={paths['heldout_mathvista']}", f"train.steps={steps}", f"train.vision.trainable={str(trainable).lower()}",
        "rollout.prompts_per_step=4", "rollout.k=2", "algo.actor_minibatches=1", "algo.critic_minibatches=1",
        "algo.critic_epochs=1", "algo.dynamic_sampling=false", "daps.enabled=false", "algo.actor_lr=1e-3",
        "train.tensorboard=false", "train.progress=false"])
    tr = Trainer(cfg)
    tower = vision_of(tr.actor)
    before = {n: p.detach().clone() for n, p in tower.hf_named_parameters()}
    sent = set()
    if tr.rank == 0:
        real = tr.engine.update_weights

        def record(named):
            named = list(named)
            sent.update(n for n, _ in named)
            return real(named)

        tr.engine.update_weights = record
    seen = capture_batches(tr)
    res = {"multimodal": tr.multimodal, "steps": [], "rows": []}
    for _ in range(steps):
        res["steps"].append({k: v for k, v in tr.step().items() if k.startswith(("r3/", "actor/", "critic/"))})
        b = seen[-1]
        if b.routes is not None:  # rank 0 (sharded flow: each rank its rows)
            for i in range(len(b.routes)):
                if b.routes[i] is None:
                    continue
                n = int(b.prompt_len[i] + b.resp_len[i])
                res["rows"].append((int(np.asarray(b.routes[i]).shape[0]), n,
                                    int((b.tokens[i, :int(b.prompt_len[i])] == 90).sum()), b.images[i] is not None))
    tr.sync_weights()  # the engine gets the last step's weights (a trainable tower among them)
    after = {n: p.detach().clone() for n, p in tower.hf_named_parameters()}
    res["changed"] = {n: not torch.equal(before[n], after[n]) for n in before}
    res["sent_visual"] = sorted(n for n in sent if n.startswith("model.visual."))
    res["sent_text"] = len([n for n in sent if not n.startswith("model.visual.")])
    if tr.rank == 0:
        visual = dict(tr.engine.model.model.visual.named_parameters())
        res["engine_equal"] = all(torch.equal(visual[n[len("model.visual."):]], p) for n, p in after.items())
        res["engine_multimodal"] = tr.engine._vision_model() is not None
    tr.close()
    return res


# frozen (~50 s here, the fixture's conversion included) stays in the fast suite; trainable is the slow variant
@pytest.mark.parametrize("trainable", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["frozen", "trainable"])
def test_three_rl_steps_on_image_prompts(miniature, tmp_path, trainable):
    paths, mcore = miniature
    r0 = run_distributed(_rl_steps, 2, paths, mcore, str(tmp_path / "run"), trainable, 3)[0]
    assert r0["multimodal"] and r0["engine_multimodal"]  # derived from the data's images
    assert len(r0["steps"]) == 3
    for m in r0["steps"]:
        assert m["r3/agreement"] == pytest.approx(1.0, abs=1e-12), m
        assert m["r3/logprob_abs_diff"] < 1e-4, m
    # the routes cover every position of each row, its 32 image placeholders included, and the rows carry images
    assert r0["rows"] and all(r == n - 1 and img == 32 and has for r, n, img, has in r0["rows"])
    assert r0["sent_text"] > 0
    if trainable:
        assert all(r0["changed"].values())
        assert r0["sent_visual"] == sorted(r0["changed"])  # hf names: model.visual.*
    else:
        assert not any(r0["changed"].values()) and r0["sent_visual"] == []
    assert r0["engine_equal"]  # frozen: the engine kept the checkpoint's tower, which the trainer's still equals
