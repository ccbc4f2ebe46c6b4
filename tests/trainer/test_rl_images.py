"""Issue 27's "Must show": RL steps with image prompts on the CPU engine (loaded multimodal because the data has
images), 2 gloo ranks (TP1 x EP2) and 4 (TP2 x EP2, slow), the tiny Qwen3.5-MoE VL miniature (examples/cpu_demo_vl.yaml, its HF dir
converted with hf_to_mcore into model.actor_init). Checked against independent references: the routers' own
top-k (no replay) against the engine's recorded routes over every position, image placeholders included
(r3/agreement == 1.0); the vision tower's weights before / after the steps (frozen: bit-equal and never in a
weight-sync bucket; ``train.vision.trainable``: changed, sent as model.visual.*, and the engine's tower equal
to the trainer's after the sync)."""
import os

import pytest
import torch

from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.config import load_config

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.fixture(scope="module")
def miniature(tmp_path_factory):
    from megatron_s3ac.convert import hf_to_mcore
    from megatron_s3ac.tasks.vision import save_vision_miniature

    root = tmp_path_factory.mktemp("rl_images")
    paths = save_vision_miniature(str(root / "data"), num_prompts=8, eval_prompts=2)
    mcore = str(root / "mcore")
    hf_to_mcore(paths["model"], mcore, progress=False)
    return paths, mcore


def _overrides(paths, mcore, out_dir, trainable, steps, tp=1):
    """examples/cpu_demo_vl.yaml on the fixture's miniature: 4 prompts x 2 samples a step, one minibatch."""
    m = paths["model"]
    return [f"model.hf_config={m}", f"model.engine_hf_dir={m}", f"model.actor_init={mcore}", f"data.path={paths['train']}",
            f"train.out_dir={out_dir}", f"eval.benchmarks.heldout={paths['heldout_mathvista']}", f"train.steps={steps}",
            f"train.vision.trainable={str(trainable).lower()}", f"actor_layout.tp={tp}",
            "rollout.prompts_per_step=4", "rollout.k=2", "algo.actor_minibatches=1", "algo.critic_minibatches=1",
            "algo.critic_epochs=1", "algo.dynamic_sampling=false", "daps.enabled=false", "algo.actor_lr=1e-3",
            "train.tensorboard=false", "train.progress=false"]


def _rl_steps(paths, mcore, out_dir, trainable, steps, tp=1):
    import numpy as np

    from megatron_s3ac.models.vision import vision_of
    from megatron_s3ac.trainer.step.trainer import Trainer
    from tests.trainer.test_trainer import capture_batches

    cfg = load_config(os.path.join(ROOT, "examples", "cpu_demo_vl.yaml"), _overrides(paths, mcore, out_dir, trainable, steps, tp))
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


# TP1 x EP2 on 2 ranks, frozen (~50 s here, the fixture's conversion included), stays in the fast suite; trainable
# and TP2 x EP2 on 4 ranks (tensor-parallel attention / GDN / vision scatter, expert-parallel MoE) are slow
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["tp1ep2", "tp2ep2"])
@pytest.mark.parametrize("trainable", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["frozen", "trainable"])
def test_three_rl_steps_on_image_prompts(miniature, tmp_path, trainable, tp):
    paths, mcore = miniature
    r0 = run_distributed(_rl_steps, 2 * tp, paths, mcore, str(tmp_path / "run"), trainable, 3, tp)[0]
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


def _carried(step_dir):
    """The ``s3ac_carried.<HF name>`` tensors of a training checkpoint's actor, whole (every block read)."""
    from megatron_s3ac.convert.dcp_io import DistcpCheckpoint

    ck = DistcpCheckpoint(os.path.join(step_dir, "actor"))
    try:
        keys = [k for k in ck.md.state_dict_metadata if k.startswith("s3ac_carried.")]
        return {k: ck.read_region(k, (0,) * len(ck.global_shape(k)), ck.global_shape(k)) for k in keys}
    finally:
        ck.close()


@pytest.mark.slow
@pytest.mark.timeout(2400)  # three 2-rank torchrun runs of the VL miniature
@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
def test_kill_and_resume_with_carried_tensors(miniature, tmp_path, trainable):
    """A VL run killed after step 3 (checkpoint of step 2: actor with its carried vision tower and MTP layer) and
    resumed gives the uninterrupted run's metrics (every key but timings, tools/compare_metrics.py's rule) and a
    final checkpoint whose carried tensors equal the uninterrupted run's bit for bit; mcore-to-hf of it is the
    complete VL directory (the input's tensor names, dtypes and side files; transformers loads it as the VL
    model); frozen: its tower and MTP tensors are the input's, trainable: its tower is not."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    from megatron_s3ac.convert import mcore_to_hf
    from megatron_s3ac.trainer.run.checkpoint import latest_checkpoint
    from tests.qwen3_5.test_vl_checkpoint import _side_files, _tensors
    from tests.trainer.test_trainer import _metrics, _torchrun

    paths, mcore = miniature
    cfg = os.path.join(ROOT, "examples", "cpu_demo_vl.yaml")
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["train.save_every=2", "train.eval_every=0"]
    r = _torchrun([cfg] + _overrides(paths, mcore, str(a), trainable, 4) + common, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _torchrun([cfg] + _overrides(paths, mcore, str(b), trainable, 4) + common, {"S3AC_TESTING_FAIL_AT_STEP": "3"}, 900)
    assert r.returncode != 0  # died after step 3, the checkpoint of step 2 on disk
    assert os.path.exists(b / "checkpoints" / "step_000002" / "COMPLETE")
    assert not os.path.exists(b / "checkpoints" / "step_000004")
    r = _torchrun([cfg] + _overrides(paths, mcore, str(b), trainable, 4) + common, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    ma, mb = _metrics(a), _metrics(b)
    assert [m["step"] for m in mb] == [0, 1, 2, 3]
    assert ma == mb
    last_a, last_b = latest_checkpoint(str(a)), latest_checkpoint(str(b))
    assert os.path.basename(last_a) == os.path.basename(last_b) == "step_000004"
    ca, cb = _carried(last_a), _carried(last_b)
    assert any(".visual." in k for k in ca) and any(k.startswith("s3ac_carried.mtp.") for k in ca)
    assert ca.keys() == cb.keys() and all(ca[k].dtype == cb[k].dtype and torch.equal(ca[k], cb[k]) for k in ca)
    src = _tensors(paths["model"])
    out = str(tmp_path / "hf_resumed")
    mcore_to_hf(os.path.join(last_b, "actor"), out, hf_config=paths["model"], progress=False)
    back = _tensors(out)
    assert back.keys() == src.keys() and all(back[k].dtype == src[k].dtype for k in src)
    assert _side_files(out) == _side_files(paths["model"]) and "preprocessor_config.json" in _side_files(out)
    for k, t in back.items():  # the HF tensor = the checkpoint's carried one
        if k.startswith(("model.visual.", "mtp.")):
            assert torch.equal(t, cb["s3ac_carried." + k]), k
    assert all(torch.equal(back[k], src[k]) for k in src if k.startswith("mtp."))
    tower_same = [torch.equal(back[k], src[k]) for k in src if k.startswith("model.visual.")]
    assert all(tower_same) if not trainable else not any(tower_same)
    assert not all(torch.equal(back[k], src[k]) for k in src if k.startswith("model.language_model."))  # trained
    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(out, dtype=torch.float32)
    assert type(model) is Qwen3_5MoeForConditionalGeneration and model.model.visual is not None


def _critic_tower_from_actor(paths, mcore, out_dir):
    import torch.distributed as dist
    from safetensors.torch import load_file

    from megatron_s3ac.models.vision import unwrap_gpt, vision_of
    from megatron_s3ac.trainer.step.trainer import Trainer

    cfg = load_config(os.path.join(ROOT, "examples", "cpu_demo_vl.yaml"), _overrides(paths, mcore, out_dir, True, 1)
                      + ["actor_layout.ep=1", "actor_layout.pp=2", "critic_layout.tp=2"])
    tr = Trainer(cfg)
    noise = lambda n, shape: 0.01 * torch.randn(shape, generator=torch.Generator().manual_seed(sum(map(ord, n))))  # noqa: E731
    first = unwrap_gpt(tr.actor).pre_process
    if first:  # the actor's tower as a warm-up leaves it (only the first pipeline stage's tower trains)
        with torch.no_grad():
            for n, p in vision_of(tr.actor).hf_named_parameters():
                p.add_(noise(n, p.shape))
    tr.init_critic_from_actor()
    src = {k: v for f in os.listdir(paths["model"]) if f.endswith(".safetensors")
           for k, v in load_file(os.path.join(paths["model"], f)).items() if k.startswith("model.visual.")}
    got = dict(vision_of(tr.critic, spare=True).hf_named_parameters())
    res = {"rank": dist.get_rank(), "actor_first_stage": first, "critic_first_stage": unwrap_gpt(tr.critic).pre_process,
           "names": sorted(got) == sorted(src),
           "equal": all(torch.equal(got[n], src[n] + noise(n, src[n].shape)) for n in src)}
    tr.close()
    return res


@pytest.mark.slow
def test_critic_takes_the_actors_trained_tower_at_another_layout(miniature, tmp_path):
    """``train.vision.trainable``: ``init_critic_from_actor`` (the pipeline's step after the warm-up) gives the critic
    the actor's trained tower with its backbone. Actor PP=2 (rank 1 holds only an untrained spare), critic TP=2 (both
    ranks are its first stage): every rank's critic tower = the checkpoint's tensors + the perturbation rank 0's actor
    tower got, recomputed here from the safetensors."""
    paths, mcore = miniature
    rs = run_distributed(_critic_tower_from_actor, 2, paths, mcore, str(tmp_path / "run"))
    assert [(r["actor_first_stage"], r["critic_first_stage"]) for r in rs] == [(True, True), (False, True)]
    assert all(r["names"] and r["equal"] for r in rs), rs


@pytest.mark.slow  # > 25 s on 2 cores; the fast suite's 20-minute budget (CI); make test-all runs it
def test_text_rl_evaluates_image_benchmarks(miniature, tmp_path):
    """Text training prompts with an image benchmark in ``eval.benchmarks`` (the paper's setting: Intern-S2 trained on
    text, evaluated on MathVista / MathVision / MMMU-Pro): the engine loads the VL checkpoint multimodal for the
    evaluation, and the periodic eval's avg@k after step 1 equals ``s3ac-eval`` on that step's training checkpoint
    (converted to HF with its carried tower), the set named as in the run so the sampling seeds agree."""
    import json

    from megatron_s3ac.eval.cli import main as eval_main
    from tests.trainer.test_trainer import _torchrun

    paths, mcore = miniature
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a, b in [(1, 2), (3, 4), (2, 2), (5, 1), (0, 3), (4, 4), (6, 2), (1, 1)]))
    out = tmp_path / "run"
    over = _overrides(paths, mcore, str(out), False, 1) + [f"data.path={text}", "train.eval_every=1",
                                                           "train.save_every=1"]
    cfg = load_config(os.path.join(ROOT, "examples", "cpu_demo_vl.yaml"), over)
    from megatron_s3ac.trainer.step.build import build_data, image_eval_sets, image_prompts

    assert image_eval_sets(cfg) == ["heldout"] and not image_prompts(build_data(cfg, use_daps=False).prompts)
    r = _torchrun([os.path.join(ROOT, "examples", "cpu_demo_vl.yaml")] + over, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert len(rows) == 1 and rows[0]["r3/agreement"] == 1.0
    got = rows[0]["eval/heldout/avg@4"]
    report = tmp_path / "report.json"
    rc = eval_main(["--model", str(out / "checkpoints" / "step_000001"), "--hf-config", paths["model"],
                    "--bench", f"heldout={paths['heldout_mathvista']}", "--schema", "heldout=mathvista", "--k", "4",
                    "--temperature", "1.0", "--max-new-tokens", "3", "--template", "raw", "--reward", "arithmetic",
                    "--out", str(report)])
    assert rc == 0
    assert json.load(open(report))["benchmarks"]["heldout"]["avg_at_k"] == got


def _offload_steps(paths, mcore, out_dir, offload):
    """Two RL steps on image prompts with the engine colocated; with ``train.offload_idle`` the frozen tower (one
    object shared by actor and critic) is off the device while the engine generates. Returns the steps' metrics
    (no timings or memory figures) and, per rollout, whether the tower's weights were on the device."""
    from megatron_s3ac.models.vision import vision_of
    from megatron_s3ac.trainer.step.trainer import Trainer

    cfg = load_config(os.path.join(ROOT, "examples", "cpu_demo_vl.yaml"),
                      _overrides(paths, mcore, out_dir, False, 2) + [f"train.offload_idle={str(offload).lower()}"])
    tr = Trainer(cfg)
    tower, at_rollout = vision_of(tr.actor), []
    real = tr.source.generate

    def spy(fn):
        at_rollout.append(next(tower.parameters()).untyped_storage().nbytes() > 0)
        return real(fn)

    tr.source.generate = spy
    steps = [{k: v for k, v in tr.step().items() if not k.startswith(("time/", "mem/"))} for _ in range(2)]
    shared = vision_of(tr.critic) is tower
    tr.close()
    return {"steps": steps, "at_rollout": at_rollout, "shared": shared}


@pytest.mark.slow  # the miniature's conversion + 2 x 2 steps on 2 ranks
def test_offload_idle_moves_the_shared_frozen_tower_and_changes_nothing(miniature, tmp_path):
    paths, mcore = miniature
    off = run_distributed(_offload_steps, 2, paths, mcore, str(tmp_path / "off"), True)
    ref = run_distributed(_offload_steps, 2, paths, mcore, str(tmp_path / "ref"), False)
    assert off[0]["shared"] and off[0]["at_rollout"] == [False, False]  # rank 0 generates: the tower was away
    assert ref[0]["at_rollout"] == [True, True]
    def same(x, y):  # NaN (an explained variance of constant returns) equals NaN
        return x == y or (isinstance(x, float) and isinstance(y, float) and x != x and y != y)

    diffs = [(i, k, a.get(k), b.get(k)) for i, (a, b) in enumerate(zip(off[0]["steps"], ref[0]["steps"]))
             for k in sorted(set(a) | set(b)) if not same(a.get(k), b.get(k))]
    assert len(off[0]["steps"]) == 2 and not diffs, diffs  # the round trip is bit-exact: the same steps


def _privileged_step(paths, mcore, out_dir):
    from transformers import AutoTokenizer

    from megatron_s3ac.trainer.step.privileged import block_text
    from megatron_s3ac.trainer.step.trainer import Trainer

    cfg = load_config(os.path.join(ROOT, "examples", "cpu_demo_vl.yaml"),
                      _overrides(paths, mcore, out_dir, False, 1) + ["actor_layout.ep=1", "model.critic_privileged=answer"])
    tr = Trainer(cfg)
    tok = AutoTokenizer.from_pretrained(paths["model"])
    seen, fwd = [], tr._forward_only

    def spy(which, batch, what):
        out = fwd(which, batch, what)
        if which == "critic":
            view = tr.critic_input(batch)
            seen.append((batch, view, out["values"]))  # [N, T] per response token
        return out

    tr._forward_only = spy
    m = tr.step()
    rows = []
    for batch, view, values in seen:
        for i in range(batch.tokens.shape[0]):
            P, R = int(batch.prompt_len[i]), int(batch.resp_len[i])
            block = tok(block_text("answer", tr.prompts[int(batch.pid[i])].reference, None, False),
                        add_special_tokens=False)["input_ids"]
            hand = batch.tokens[i, :P].tolist() + list(block) + batch.tokens[i, P:P + R].tolist()
            rows.append((view.tokens[i, :len(hand)].tolist() == hand, int(view.prompt_len[i]) == P + len(block),
                         int((batch.tokens[i, :P] == 90).sum()), view.images[i] is batch.images[i]))
    tr.close()
    return {"rows": rows, "missing": m["critic/privileged_missing"], "ev": m.get("critic/explained_variance"),
            "finite": all(bool(torch.isfinite(v).all()) for *_, v in seen)}


@pytest.mark.slow  # the miniature's conversion + one step of the VL model on one rank (~40 s here)
def test_privileged_block_follows_the_image_prompt(miniature, tmp_path):
    """model.critic_privileged=answer on the VL model: the critic reads image prompt (its placeholders) + the text
    block in the model's tokenizer + response, the images the actor's, for every row of the step."""
    paths, mcore = miniature
    r = run_distributed(_privileged_step, 1, paths, mcore, str(tmp_path))[0]
    assert r["rows"] and r["missing"] == 0 and r["finite"]
    assert all(same and plen for same, plen, _, _ in r["rows"])
    assert all(n > 0 and img for _, _, n, img in r["rows"])  # every row an image prompt, its images carried
