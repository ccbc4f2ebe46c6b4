"""The trainer with rollout.engine=sglang against the sglang 0.5.23 stand-in (a real transformers model behind it):
3 steps on 2 gloo ranks (EP=2), one colocated engine with tp_size=2 whose TP ranks sit on the two ranks' devices;
after every sync the engine's tensors equal the trainer's export exactly and each TP rank's payloads were produced
by the trainer rank on its device (rollout.engines.sglang.colocated), the step's train/rollout KL is ~0 (the engine samples from
the synced weights), and aborted samples are counted (their groups dropped) without crashing the step. Plus
`s3ac-train check` on sglang configs."""
import os
import sys

import pytest

from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.config import ConfigError, load_config, validate

HERE = os.path.dirname(os.path.abspath(__file__))
BASE = ["rollout.prompts_per_step=4", "rollout.k=4", "rollout.max_new_tokens=4", "data.num_prompts=200",
        "data.eval_prompts=8", "algo.actor_minibatches=4", "algo.critic_minibatches=4", "daps.warmup_steps=0",
        "daps.rampup_steps=1", "train.progress=false", "train.tensorboard=false", "train.eval_every=0",
        "algo.dynamic_sampling=false", "actor_layout.ep=2"]


@pytest.fixture(scope="module")
def arith_dir(tmp_path_factory):
    """The demo's arithmetic Qwen3-MoE as an HF directory (config, random safetensors, character tokenizer):
    what sglang needs to start from."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_s3ac.models.tiny_models import char_tokenizer
    from megatron_s3ac.data.prompts import ARITH_CHARS
    from megatron_s3ac.tasks.arithmetic import tiny_arithmetic_hf_config

    path = str(tmp_path_factory.mktemp("arith_hf"))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_arithmetic_hf_config()).save_pretrained(path)
    char_tokenizer(ARITH_CHARS).save_pretrained(path)
    return path


def sglang_overrides(path):
    return [f"model.hf_config={path}", f"model.engine_hf_dir={path}", "rollout.engine=sglang",
            "rollout.sglang.bucket_mb=1"]


COLOCATED_TP2 = ["rollout.sglang.tp_size=2", "rollout.sglang.gpus_per_engine=2"]


def _three_steps(path, out_dir):
    import torch
    from megatron.core import parallel_state as ps

    sys.path.insert(0, HERE)
    import megatron_s3ac.rollout.factory as F
    from fake_sglang import FakeSGLangEngine
    from megatron_s3ac.convert.export import export_hf_weights
    from megatron_s3ac.trainer.step.trainer import Trainer

    F.SGLANG_ENGINE_CLS = FakeSGLangEngine
    tr = Trainer(load_config(None, BASE + sglang_overrides(path) + COLOCATED_TP2 + [f"train.out_dir={out_dir}"]))
    rank0 = tr.engine is not None

    def verify():
        """Every tensor the trainer exports equals the engine's (rank 0) after the sync."""
        chunks = list(tr.actor) if isinstance(tr.actor, (list, tuple)) else [tr.actor]
        exported = {}
        for bucket in export_hf_weights(chunks, tr.info, 1 << 20,
                                        group=ps.get_tensor_and_data_parallel_group(with_context_parallel=True)):
            exported.update({n: t.clone() for n, t in bucket})
        if not rank0:
            return None
        served = tr.engine.engine.debug_checkpoint_state_dict()
        diff = max(float((served[n].float() - t.float()).abs().max()) for n, t in exported.items())
        return len(exported), diff, sorted(set(served) - set(exported))

    out = {"init": verify(), "steps": [], "checks": []}
    for step in range(3):
        if rank0 and step == 1:
            tr.engine.engine.abort_requests = {0, 5}  # sample 0 of prompt 0, sample 1 of prompt 1
        before = [p.detach().clone() for p in tr.actor.parameters()]
        out["steps"].append(tr.step())
        out["trained"] = any(not torch.equal(a, b) for a, b in zip(before, tr.actor.parameters()))
        out["checks"].append(verify())
    out["calls"] = list(tr.engine.engine.calls) if rank0 else None
    out["payloads"] = list(tr.engine.engine.debug_payload_log) if rank0 else None
    out["pid"] = os.getpid()
    tr.close()
    return out


def test_three_steps_with_the_sglang_stand_in(arith_dir, tmp_path):
    r0, r1 = run_distributed(_three_steps, 2, arith_dir, str(tmp_path))
    for n, diff, unsent in [r0["init"]] + r0["checks"]:
        assert n > 20 and diff == 0.0 and unsent == []  # engine-side tensors == the trainer's export
    assert r1["init"] is None
    aborted = [m["rollout/aborted"] for m in r0["steps"]]
    assert aborted == [0, 2, 0] and r0["steps"][1]["rollout/aborted_groups"] == 2
    assert [m["rollout/aborted"] for m in r1["steps"]] == aborted  # every rank sees the same count
    for m in r0["steps"]:
        assert abs(m["mismatch/train_rollout_kl"]) < 1e-5  # rollouts came from the synced weights
        assert m["actor/opt_steps"] >= 1
    assert r0["trained"]
    log = r0["payloads"]  # every bucket of every sync: TP rank t read the handle of trainer rank t (its device)
    assert len(log) >= 4
    assert all(e["producers"] == [r0["pid"], r1["pid"]] and e["matches_rank0"] == [True, True] for e in log)
    calls = r0["calls"]
    # colocated: release all, then per sync: wake weights, one session, flush, wake kv_cache + cuda_graph
    syncs = [i for i, c in enumerate(calls) if c == "begin_weight_update"]
    assert len(syncs) == 4  # the initial sync + one per step
    for i in syncs[1:]:
        assert calls[i - 1] == "resume_memory_occupation"
        j = calls.index("end_weight_update", i)
        assert set(calls[i + 1:j]) == {"update_weights_from_tensor"}
        assert calls[j + 1:j + 3] == ["flush_cache", "resume_memory_occupation"]


def test_check_accepts_sglang_and_refuses_inconsistent(arith_dir):
    cfg = load_config(None, BASE + sglang_overrides(arith_dir) + ["rollout.sglang.num_engines=2"])
    validate(cfg, world_size=2)  # colocated: 2 engines x 1 GPU on the trainer's 2 GPUs
    with pytest.raises(ConfigError, match="rollout.sglang.num_engines: 1 engines x 1 GPUs = 1 GPUs, but colocated"):
        validate(load_config(None, BASE + sglang_overrides(arith_dir)), world_size=2)  # a trainer GPU without engine
    with pytest.raises(ConfigError, match="rollout.sglang.num_engines: 3 engines x 1 GPUs = 3 GPUs, but colocated"):
        validate(load_config(None, BASE + sglang_overrides(arith_dir) + ["rollout.sglang.num_engines=3"]),
                 world_size=2)
    with pytest.raises(ConfigError, match="rollout.sglang.gpus_per_engine: 4 GPUs per engine but tp_size=2"):
        load_config(None, BASE + sglang_overrides(arith_dir) + ["rollout.sglang.gpus_per_engine=4",
                                                                 "rollout.sglang.tp_size=2",
                                                                 "rollout.sglang.attn_dp_size=2"])
    sep = load_config(None, BASE + sglang_overrides(arith_dir) + ["rollout.placement=separate", "cluster.gpus=8",
                                                                  "rollout.sglang.num_engines=4"])
    validate(sep, world_size=4)
    with pytest.raises(ConfigError, match="rollout.sglang.num_engines: 4 engines x 1 GPUs = 4 GPUs, but the cluster"):
        validate(sep, world_size=6)
    with pytest.raises(ConfigError, match="rollout.engine: sglang cannot serve the built-in tiny model"):
        load_config(None, BASE + ["model.tiny=arithmetic_moe", "rollout.engine=sglang"])
    load_config(None, BASE + ["model.tiny=arithmetic_moe", "rollout.engine=cpu"])  # the demo keeps working


def test_check_cli_names_the_key(arith_dir, capsys):
    from megatron_s3ac.trainer.cli import main

    assert main(["check"] + BASE + sglang_overrides(arith_dir) + ["rollout.sglang.attn_dp_size=3"]) != 0
    assert "rollout.sglang.attn_dp_size" in capsys.readouterr().err
    assert main(["check"] + BASE + sglang_overrides(arith_dir)) == 0


# ---- image prompts through the sglang stand-in (the VL miniature), colocated TP2 on 2 ranks ---------------------
def _vl_with_sglang(paths, mcore, out_dir, trainable):
    """The trainer on image prompts with rollout.engine=sglang: one step (its sync), then a sleep -> sync cycle
    without training (the image prompt's seeded generation before and after); the names every sync sent and the
    engine's tower against the trainer's."""
    import torch
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    sys.path.insert(0, HERE)
    import megatron_s3ac.rollout.factory as F
    from fake_sglang import FakeSGLangEngine
    from megatron_s3ac.convert.export import export_hf_weights
    from megatron_s3ac.models.vision import vision_of
    from megatron_s3ac.rollout.base import SamplingParams
    from megatron_s3ac.trainer.step.trainer import Trainer
    from tests.trainer.test_rl_images import ROOT, _overrides

    F.SGLANG_ENGINE_CLS = FakeSGLangEngine
    cfg = load_config(os.path.join(ROOT, "examples", "cpu_demo_vl.yaml"),
                      _overrides(paths, mcore, out_dir, trainable, 1)
                      + ["rollout.engine=sglang", "rollout.sglang.bucket_mb=1"] + COLOCATED_TP2)
    tr = Trainer(cfg)
    rank0 = tr.engine is not None
    p = tr.prompts[0]
    sp = SamplingParams(temperature=1.0, max_new_tokens=3, seed=5)

    def gen():
        s = tr.engine.generate([p.ids], sp, images=[p.images])[0][0]
        return list(s.response_ids), [float(x) for x in s.logprobs]

    out = {"backup": tr.engine.config.enable_weights_cpu_backup if rank0 else None}
    tr.step()  # rollout, sleep, train, sync (the trained weights; a trainable tower among them)

    def nans():  # a served tensor a sync left unsent after a release is NaN (the stand-in's released memory)
        return sorted(n for n, t in tr.engine.engine.debug_checkpoint_state_dict().items()
                      if t.is_floating_point() and torch.isnan(t).any())

    flag = [nans() if rank0 else None]
    torch.distributed.broadcast_object_list(flag, src=0)
    out["nan_after_step"] = flag[0]
    if flag[0]:  # every rank stops here (the rest is collective)
        out["sent"] = sorted({n for e in tr.engine.engine.debug_payload_log for n in e["names"]}) if rank0 else []
        tr.close()
        return out
    # the routed experts the engine serves after the step's sync against the trainer's export (collective), and
    # against the checkpoint's: stale experts (a sync whose expert names the loader skipped) equal the checkpoint
    exported = {}
    chunks = list(tr.actor) if isinstance(tr.actor, (list, tuple)) else [tr.actor]
    for bucket in export_hf_weights(chunks, tr.info, 1 << 20,
                                    group=ps.get_tensor_and_data_parallel_group(with_context_parallel=True)):
        exported.update({n: t.detach().clone() for n, t in bucket if ".mlp.experts." in n})
    if rank0:
        served = tr.engine.engine.debug_checkpoint_state_dict()
        ckpt = {}
        for f in sorted(os.listdir(paths["model"])):
            if f.endswith(".safetensors"):
                ckpt.update(load_file(os.path.join(paths["model"], f)))
        out["experts"] = sorted(exported)
        out["experts_served"] = [n for n, t in sorted(exported.items()) if torch.equal(served[n], t.float())]
        out["experts_trained"] = [n for n, t in sorted(exported.items()) if not torch.equal(ckpt[n].float(), t.float())]
    before = gen() if rank0 else None
    tr.engine_sleep()  # rank 0's strategy: every tag released
    tr.sync_weights()  # wake weights -> the actor's export -> wake kv_cache + cuda_graph
    out["nan_after_wake"] = nans() if rank0 else None
    out["same_after_wake"] = (not out.get("nan_after_wake") and gen() == before) if rank0 else None
    tower = {n: t.detach().clone() for n, t in vision_of(tr.actor).hf_named_parameters()}
    if rank0:
        eng = tr.engine.engine
        out["sent"] = sorted({n for e in eng.debug_payload_log for n in e["names"]})
        served = eng.debug_checkpoint_state_dict()
        out["tower_equal"] = all(torch.equal(served[n], t) for n, t in tower.items())
        out["tower"] = sorted(tower)
    tr.close()
    return out


@pytest.fixture(scope="module")
def vl_miniature(tmp_path_factory):
    from megatron_s3ac.convert import hf_to_mcore
    from megatron_s3ac.tasks.vision import save_vision_miniature

    root = tmp_path_factory.mktemp("sglang_vl")
    paths = save_vision_miniature(str(root / "data"), num_prompts=8, eval_prompts=2)
    hf_to_mcore(paths["model"], str(root / "mcore"), progress=False)
    return paths, str(root / "mcore")


@pytest.mark.slow
@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
def test_vl_tower_with_the_sglang_stand_in(vl_miniature, tmp_path, trainable):
    """Frozen: the engine starts with sglang's weights CPU backup (resident tower), no sync sends model.visual.*,
    the image prompt's generation after sleep / wake equals the one before, and the served tower is the trainer's
    (= the checkpoint's). Trainable: no backup, every sync sends the tower, and after the step's sync the served
    tower equals the trained one. Both: after the step's sync the engine's routed experts (sent fused,
    ``mlp.experts.gate_up_proj`` / ``down_proj``, as sglang's Qwen3.5-MoE loader takes them) equal the trainer's
    export, which the step moved away from the checkpoint's (so stale experts fail)."""
    paths, mcore = vl_miniature
    r0 = run_distributed(_vl_with_sglang, 2, paths, mcore, str(tmp_path), trainable)[0]
    assert r0["nan_after_step"] == [], (r0["nan_after_step"][:5], [n for n in r0["sent"] if "visual" in n][:5])
    assert r0["experts"] and all(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in r0["experts"])
    assert r0["experts_served"] == r0["experts"]
    assert r0["experts_trained"] == r0["experts"]
    visual = [n for n in r0["sent"] if n.startswith("model.visual.")]
    assert r0["sent"] and r0["tower"]
    assert r0["backup"] is (not trainable)
    assert visual == (r0["tower"] if trainable else [])
    assert r0["nan_after_wake"] == [] and r0["same_after_wake"]
    assert r0["tower_equal"]
