"""``s3ac-train rehearse`` (issue 41): the example configs rehearse clean, and the rehearsal names the defect when a
fix of the second GPU-path review is undone (each undone in this process the way the code read before its fix):

* finding 2 (vLLM servers started without their own devices): every engine on the node's first GPUs;
* finding 4 (``vllm.LLM(data_parallel_size > 1)``): vLLM's own rule on the keywords the server gets;
* finding 5 (Qwen3.5 built from torch modules on a GPU with TE): the layer spec against the planner's TE kernels;
* finding 7 (routed experts turned prefix caching off): the keywords again;
* finding 1's class (engines on the trainer's GPUs): the launch script's split, read from the script itself.

Independent references: the GPU indices follow from the launch script's variables and vLLM's / SGLang's device
rules by hand (engine e of g GPUs after T trainer ranks: T + e*g ..); Ray places the SGLang pool for real.
"""
import os
import shutil

import pytest

from tests._examples import EXAMPLES, ROOT

VLLM_SEPARATE = ["rollout.engine=vllm", "rollout.placement=separate", "rollout.vllm.num_engines=2",
                 "rollout.vllm.gpus_per_engine=2", "rollout.vllm.tp_size=2", "actor_layout.tp=1"]
MOE = ["examples/paper/qwen3_30b_a3b_ep.yaml", "model.hf_config=examples/hf_configs/qwen3_30b_a3b"]


def _rehearse(capsys, monkeypatch, args, trainer_gpus=None, run=False):
    from megatron_s3ac.trainer.cli import main

    monkeypatch.chdir(ROOT)
    if trainer_gpus is None:
        monkeypatch.delenv("TRAINER_GPUS_PER_NODE", raising=False)
    else:
        monkeypatch.setenv("TRAINER_GPUS_PER_NODE", str(trainer_gpus))
    rc = main(["rehearse", *args] + ([] if run else ["--no-run"]))
    cap = capsys.readouterr()
    _rehearse.err = cap.err
    return rc, cap.out


def _engine_lines(out):
    return [line.strip() for line in out.splitlines() if line.strip().startswith(("vllm engine", "sglang engine"))]


@pytest.mark.parametrize("example,hf", EXAMPLES[3:4] + [pytest.param(*e, marks=pytest.mark.slow) for e in
                                                         EXAMPLES[:3] + EXAMPLES[4:6]] + EXAMPLES[6:])
def test_example_configs_rehearse_clean(capsys, monkeypatch, example, hf):
    rc, out = _rehearse(capsys, monkeypatch, [example, f"model.hf_config=examples/hf_configs/{hf}"])
    assert rc == 0, out
    assert "rehearsal: no defect found" in out
    assert "[ok] config" in out and "[ok] engines" in out and "[ok] kernels" in out


# all slow (the 1.5B's two-rank pipeline + resume is ~60-100 s here): the fast suite runs the run phase's rank code on
# a tiny job instead (tests/gpu_readiness/test_rehearse_residency.py)
@pytest.mark.parametrize("example,hf", [pytest.param(*e, marks=pytest.mark.slow) for e in
                                        (EXAMPLES[0], EXAMPLES[3], EXAMPLES[5])])
def test_example_configs_shrunk_job_runs_clean(capsys, monkeypatch, example, hf):
    """The run phase: the shrunk job through pipeline + resume on CPU ranks (1.5B: 2 ranks; the MoE examples: 8)."""
    rc, out = _rehearse(capsys, monkeypatch, [example, f"model.hf_config=examples/hf_configs/{hf}"], run=True)
    assert rc == 0, out
    assert "[ok] run" in out
    assert "pipeline: coverage -> value pretraining -> RL, eval + checkpoint each step: steps [0, 1]" in out
    assert "resume: the RL stage one more step from its checkpoint (default group timeout 15 s, rank 0's engine 16 s " \
           "slower to start and per generation): steps [0, 1, 2]" in out


def test_smallest_world_keeping_the_degrees():
    """By hand: lcm(tp*pp*cp, etp*ep*pp), doubled once for a dense DP of 2 where it fits."""
    from megatron_s3ac.models.parallel import ParallelLayout
    from megatron_s3ac.trainer.rehearse_run import min_world

    assert min_world([ParallelLayout()], 8) == 2  # 1.5B: DP 2
    assert min_world([ParallelLayout(tp=2, ep=8, etp=1)], 8) == 8  # 30B / 35B: dense DP 4 already
    assert min_world([ParallelLayout(tp=2, pp=4, ep=32, etp=1)], 8) == 128  # the 397B: beyond --max-ranks
    assert min_world([ParallelLayout(tp=2, pp=2)], 8) == 8
    assert min_world([ParallelLayout(tp=2, pp=2)], 4) == 4  # 2 x 4 does not fit 4 ranks: DP 1


def test_run_phase_names_the_failing_rank_and_where(monkeypatch, tmp_path):
    import megatron_s3ac.trainer.rehearse_run as rr
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.rehearse import Phase

    tb = ('Traceback (most recent call last):\n  File "/x/site-packages/torch/a.py", line 1, in f\n'
          '  File "/r/megatron_s3ac/trainer/stages/pipeline.py", line 502, in _run_value_pretrain\n'
          '  File "/x/site-packages/torch/b.py", line 9, in g\nRuntimeError: boom\n')
    monkeypatch.setattr(rr, "run_with_pg_timeout", lambda fn, world, pg_timeout, *a, **k: [
        {"result": None, "records": [], "error": tb}, {"result": None, "records": [], "error": None}])
    monkeypatch.chdir(ROOT)
    cfg = load_config(MOE[0], MOE[1:], check=False)
    p = Phase("run")
    rr.run_phase(cfg, str(tmp_path / "job"), 8, p)
    assert p.defects == ["pipeline: coverage -> value pretraining -> RL, eval + checkpoint each step: rank 0: "
                         "RuntimeError: boom (at trainer/stages/pipeline.py:502 in _run_value_pretrain)"]
    assert p.tracebacks == [tb]


def _exit_on_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(7)
    return "ok"


def test_a_rank_dying_without_an_answer_is_named_at_once():
    """A rank killed mid-job (OOM killer, a native crash): named with its exit code, not after the timeout."""
    from megatron_s3ac.models.gloo_ranks import DistributedTestError, run_distributed

    with pytest.raises(DistributedTestError, match="rank 1's process exited with code 7 without answering"):
        run_distributed(_exit_on_rank_1, 2, timeout=120.0)


def test_vllm_separate_engines_after_the_trainer_ranks(capsys, monkeypatch):
    rc, out = _rehearse(capsys, monkeypatch, MOE + VLLM_SEPARATE, trainer_gpus=4)
    assert rc == 0, out
    # by hand: 4 trainer ranks take GPUs 0..3; engine e of 2 GPUs takes 4 + 2e, 5 + 2e
    assert _engine_lines(out) == ["vllm engine 0: node 0 GPUs [4, 5] (CUDA_VISIBLE_DEVICES=4,5)",
                                  "vllm engine 1: node 0 GPUs [6, 7] (CUDA_VISIBLE_DEVICES=6,7)"]


def test_finding_2_undone_engines_without_devices(capsys, monkeypatch):
    from megatron_s3ac.rollout.engines.vllm.engine import VLLMEngine

    fixed = VLLMEngine.server_env
    monkeypatch.setattr(VLLMEngine, "server_env", lambda self, env: {
        k: v for k, v in fixed(self, env).items() if k != "CUDA_VISIBLE_DEVICES"})  # the server env before 910d2fe
    rc, out = _rehearse(capsys, monkeypatch, MOE + VLLM_SEPARATE, trainer_gpus=4)
    assert rc == 1
    assert "DEFECT: vllm engine 0 worker 0 on node 0 GPU 0 is trainer local rank 0's GPU" in out
    assert "DEFECT: vllm engine 1 worker 0 on node 0 GPU 0 and vllm engine 0 worker 0 on node 0 GPU 0: two engine " \
           "workers on one GPU" in out
    assert "gpu_worker.py:498" in out  # why: vLLM's own rule for a server that sees every GPU


def test_finding_4_undone_data_parallel_engine(capsys, monkeypatch):
    import megatron_s3ac.rollout.engines.vllm.settings as vs

    real = vs.validate_vllm_settings

    def before_3cca24a(s, **kw):  # dp_size accepted as long as the GPUs add up
        import dataclasses
        return real(dataclasses.replace(s, dp_size=1, gpus_per_engine=s.tp_size), **kw)

    monkeypatch.setattr(vs, "validate_vllm_settings", before_3cca24a)
    rc, out = _rehearse(capsys, monkeypatch, MOE + VLLM_SEPARATE + ["rollout.vllm.num_engines=1",
                                                                     "rollout.vllm.dp_size=2",
                                                                     "rollout.vllm.gpus_per_engine=4"], trainer_gpus=4)
    assert rc == 1
    assert "vllm engine 0: vllm.LLM(data_parallel_size=2) raises in vLLM itself (entrypoints/llm.py:282-294)" in out
    # the same defect through a pass-through keyword, with every fix in place
    monkeypatch.undo()
    rc, out = _rehearse(capsys, monkeypatch, MOE + VLLM_SEPARATE + ["rollout.vllm.extra.data_parallel_size=2"],
                        trainer_gpus=4)
    assert rc == 1 and "vllm.LLM(data_parallel_size=2) raises in vLLM itself" in out


def test_finding_7_undone_prefix_caching_off(capsys, monkeypatch):
    import megatron_s3ac.rollout.engines.vllm.gpu as gpu

    fixed = gpu.gpu_llm_kwargs

    def before_4070531(s, return_routed_experts, *a, **k):
        kw = fixed(s, return_routed_experts, *a, **k)
        if return_routed_experts:
            kw["enable_prefix_caching"] = False
        return kw

    monkeypatch.setattr(gpu, "gpu_llm_kwargs", before_4070531)
    rc, out = _rehearse(capsys, monkeypatch, MOE + VLLM_SEPARATE, trainer_gpus=4)
    assert rc == 1
    assert "vllm engine 0: routed-expert capture with enable_prefix_caching=False" in out


def test_finding_5_undone_qwen3_5_torch_spec_on_gpu(capsys, monkeypatch):
    from megatron_s3ac.models import qwen3_5
    from megatron_s3ac.models.qwen3_5_spec import qwen3_5_block_spec

    monkeypatch.setattr(qwen3_5.Qwen35Moe, "block_spec",  # before d4449a5: None read as False
                        lambda self, config, info, use_te, pp_rank=None: qwen3_5_block_spec(
                            config, use_te=bool(use_te), pp_rank=pp_rank))
    rc, out = _rehearse(capsys, monkeypatch, ["examples/qwen3_5/qwen3_5_35b_a3b.yaml",
                                              "model.hf_config=examples/hf_configs/qwen3_5_35b_a3b"])
    assert rc == 1
    assert "[FAIL] kernels" in out and "qwen3_5_moe: on a GPU with Transformer Engine the layers are built from " \
                                      "torch modules" in out


def test_finding_1_class_launch_script_gives_ray_the_trainers_gpus(capsys, monkeypatch, tmp_path):
    """launch.sh as it read before 7911234 (Ray and torchrun both given every GPU): SGLang's separate engines are
    placed by Ray on GPUs the trainer's ranks use."""
    import megatron_s3ac.trainer.rehearse as rh

    src = open(os.path.join(ROOT, "examples/paper/launch.sh")).read()
    old = src.replace('CUDA_VISIBLE_DEVICES=$ENGINE_DEVICES ray start', 'ray start').replace(
        '--num-gpus "$RAY_GPUS"', '--num-gpus "$GPUS_PER_NODE"').replace(
        '--nproc-per-node "$TRAINER_GPUS_PER_NODE"', '--nproc-per-node "$GPUS_PER_NODE"')
    assert old != src
    script = tmp_path / "launch.sh"
    script.write_text(old)
    monkeypatch.setattr(rh, "LAUNCH", str(script))
    rc, out = _rehearse(capsys, monkeypatch, MOE + ["rollout.placement=separate", "rollout.sglang.num_engines=2",
                                                    "actor_layout.tp=1", "actor_layout.ep=4", "cluster.gpus=8"],
                        trainer_gpus=4)
    assert rc == 1
    assert "DEFECT: sglang engine 0 worker 0 on node 0 GPU 0 is trainer local rank 0's GPU" in out
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.parametrize("args,trainer_gpus,message", [
    (MOE[:1] + ["model.hf_config=/nonexistent"], None, "model.hf_config: /nonexistent does not exist here"),
    (MOE + ["cluster.gpus=12"], None, "cluster.gpus: 12 is not a whole number of nodes of 8 GPUs"),
    (MOE + ["cluster.gpus=0"], None, "cluster.gpus: not set"),
    (MOE, 9, "TRAINER_GPUS_PER_NODE=9 must be 1..GPUS_PER_NODE (8)"),
    (MOE + ["--max-group-ranks", "0"], None, "--max-group-ranks '0' must be a positive integer"),
])
def test_bad_input_exits_2_naming_it(capsys, monkeypatch, args, trainer_gpus, message):
    rc, out = _rehearse(capsys, monkeypatch, args, trainer_gpus=trainer_gpus)
    assert rc == 2 and message in _rehearse.err and "Traceback" not in _rehearse.err


# launch.sh per node: a 3-node job (cluster.gpus=24) so a middle node is checked too; vLLM's engines need no Ray
NODES3 = MOE + VLLM_SEPARATE + ["cluster.gpus=24", "actor_layout.ep=4", "critic_layout.ep=4"]


def _broken_launch(monkeypatch, tmp_path, old, new):
    import megatron_s3ac.trainer.rehearse as rh

    src = open(os.path.join(ROOT, "examples/paper/launch.sh")).read()
    assert src.count(old) == 1
    script = tmp_path / "launch.sh"
    script.write_text(src.replace(old, new))
    monkeypatch.setattr(rh, "LAUNCH", str(script))


def test_launch_sh_is_run_and_checked_on_every_node(capsys, monkeypatch):
    """By hand: node r runs torchrun --node-rank r of 3 with ranks cuda:0..3; node 0 starts Ray's head on GPUs
    4..7, nodes 1 and 2 join it at MASTER_ADDR:6379 on theirs."""
    rc, out = _rehearse(capsys, monkeypatch, NODES3, trainer_gpus=4)
    assert rc == 0, out
    assert "launch.sh node 0: ray start --head on GPUs [4, 5, 6, 7]; torchrun --node-rank 0 --nnodes 3, 4 ranks " \
           "(cuda:0..3)" in out
    for r in (1, 2):
        assert f"launch.sh node {r}: ray start --address 10.0.0.1:6379 on GPUs [4, 5, 6, 7]; torchrun --node-rank " \
               f"{r} --nnodes 3, 4 ranks (cuda:0..3)" in out
    assert "launch.sh on every node: " in out and "world 12" in out


def test_launch_sh_node_rank_not_per_node_is_a_defect(capsys, monkeypatch, tmp_path):
    _broken_launch(monkeypatch, tmp_path, '--node-rank "$NODE_RANK"', "--node-rank 0")
    rc, out = _rehearse(capsys, monkeypatch, NODES3, trainer_gpus=4)
    assert rc == 1
    assert "DEFECT: node 1 of 3: torchrun --node-rank 0 (NODE_RANK=1): two nodes' ranks collide" in out
    assert "DEFECT: node 2 of 3: torchrun --node-rank 0 (NODE_RANK=2)" in out
    assert "node 0 of 3: torchrun" not in out


def test_launch_sh_engine_split_only_on_node_0_is_a_defect(capsys, monkeypatch, tmp_path):
    """The joining nodes' ray start without the engine GPUs (the split done in the head's branch only): their Ray
    hands out the trainer ranks' GPUs."""
    _broken_launch(monkeypatch, tmp_path, 'until CUDA_VISIBLE_DEVICES=$ENGINE_DEVICES ray start', 'until ray start')
    rc, out = _rehearse(capsys, monkeypatch, NODES3, trainer_gpus=4)
    assert rc == 1
    assert "DEFECT: node 1 of 3: Ray's GPUs [0, 1, 2, 3] (ray start's CUDA_VISIBLE_DEVICES / --num-gpus) include " \
           "trainer local ranks [0, 1, 2, 3]'s GPUs" in out
    assert "DEFECT: node 2 of 3: Ray's GPUs [0, 1, 2, 3]" in out and "DEFECT: node 0 of 3" not in out


def test_launch_sh_join_and_rendezvous_checked_per_node(monkeypatch, tmp_path):
    """Each node-level rule on launch.sh's own lines, a rule broken at a time."""
    import dataclasses

    import megatron_s3ac.trainer.rehearse as rh

    monkeypatch.setenv("TRAINER_GPUS_PER_NODE", "4")
    monkeypatch.setenv("MASTER_PORT", "29500")  # launch.sh takes the caller's (an earlier test may have set one)
    good = rh.launch_nodes(3, 8, rh.LAUNCH)
    assert rh.node_defects(good, 3, 8, "separate") == []
    bad = lambda n, **kw: [dataclasses.replace(x, **kw) if x.rank == n else x for x in good]
    head_ray = good[1].ray.replace("--address 10.0.0.1:6379", "--head --port 6379")
    assert rh.node_defects(bad(1, ray=head_ray), 3, 8, "separate") == [
        "node 1 of 3: `ray start --head --port 6379 --num-gpus 4 --disable-usage-stats` does not join the head's Ray "
        "at 10.0.0.1:6379 (ray start --address; MASTER_ADDR=10.0.0.1 on every node)"]
    run2 = good[2].torchrun.replace("--nnodes 3", "--nnodes 1").replace("10.0.0.1:29500", "localhost:29500")
    assert rh.node_defects(bad(2, torchrun=run2), 3, 8, "separate") == [
        "node 2 of 3: torchrun --nnodes 1, the job has 3 nodes",
        "node 2 of 3: torchrun --rdzv-endpoint localhost:29500, node 0's is 10.0.0.1:29500: the nodes do not meet"]
    run1 = good[1].torchrun.replace("--nproc-per-node 4", "--nproc-per-node 8")
    assert rh.node_defects(bad(1, torchrun=run1), 3, 8, "separate") == [
        "node 1 of 3: torchrun --nproc-per-node 8, node 0's is 4",
        "node 1 of 3: Ray's GPUs [4, 5, 6, 7] (ray start's CUDA_VISIBLE_DEVICES / --num-gpus) include trainer local "
        "ranks [4, 5, 6, 7]'s GPUs (torchrun --nproc-per-node 8: cuda:LOCAL_RANK); rollout.placement: separate puts "
        "the engines there"]
    assert rh.node_defects(bad(2, error="exit 1"), 3, 8, "separate") == ["node 2 of 3: exit 1"]


def test_very_many_nodes_run_node_0_1_and_the_last():
    from megatron_s3ac.trainer.rehearse import ALL_NODES_UP_TO, node_ranks

    assert node_ranks(3) == [0, 1, 2] and node_ranks(ALL_NODES_UP_TO) == list(range(ALL_NODES_UP_TO))
    assert node_ranks(64) == [0, 1, 63]


SGLANG_2_NODES = MOE + ["rollout.placement=separate", "rollout.sglang.num_engines=4", "actor_layout.tp=1",
                        "actor_layout.ep=4"]


@pytest.mark.slow  # a 2-node fake Ray cluster (ray.cluster_utils.Cluster): ~40 s here
def test_sglang_engines_placed_on_every_fake_node(capsys, monkeypatch):
    """By hand: 2 nodes, 4 trainer ranks each; Ray gets GPUs 4..7 of each node, 2 engines of 2 GPUs per node."""
    rc, out = _rehearse(capsys, monkeypatch, SGLANG_2_NODES, trainer_gpus=4)
    assert rc == 0, out
    lines = _engine_lines(out)
    assert len(lines) == 4 and sum("node 1 GPUs" in x for x in lines) == 2, lines
    assert all(any(f"GPUs {g}" in x for g in ("[4, 5]", "[6, 7]")) for x in lines), lines


@pytest.mark.slow
def test_sglang_engines_on_node_1_catch_its_broken_split(capsys, monkeypatch, tmp_path):
    """launch.sh's engine split undone on the joining nodes: the engines Ray places on node 1 are on its trainer
    ranks' GPUs (the node check names the script's line, the device check the engines)."""
    _broken_launch(monkeypatch, tmp_path, 'until CUDA_VISIBLE_DEVICES=$ENGINE_DEVICES ray start', 'until ray start')
    rc, out = _rehearse(capsys, monkeypatch, SGLANG_2_NODES, trainer_gpus=4)
    assert rc == 1
    assert "DEFECT: node 1 of 2: Ray's GPUs [0, 1, 2, 3]" in out
    assert "worker 0 on node 1 GPU 0 is trainer local rank 0's GPU" in out and "on node 0 GPU 0" not in out


@pytest.mark.slow
def test_sglang_engine_spanning_two_nodes_is_placed_part_by_part(capsys, monkeypatch):
    rc, out = _rehearse(capsys, monkeypatch, MOE + ["rollout.sglang.num_engines=1", "rollout.sglang.gpus_per_engine=16",
                                                    "rollout.sglang.tp_size=16", "rollout.sglang.ep_size=16"])
    assert rc == 0, out
    lines = sorted(_engine_lines(out))
    assert [x.split(":")[0] for x in lines] == ["sglang engine 0 node part 0 of 2", "sglang engine 0 node part 1 of 2"]
    assert {x.split(": ", 1)[1].split(" GPUs")[0] for x in lines} == {"node 0", "node 1"}


def test_degrees_reduced_to_fit_max_ranks():
    """By hand: the 397B's TP2 PP4 EP32 needs lcm(8, 128) = 128 ranks; EP halves to 2 (4 steps) -> lcm(8, 8) = 8.
    Every degree that was >= 2 stays >= 2; a layout that fits is left alone; nothing fits 2 ranks at TP2 PP2."""
    from megatron_s3ac.models.parallel import ParallelLayout
    from megatron_s3ac.trainer.rehearse_run import min_world, reduced_layouts

    fit, notes = reduced_layouts([ParallelLayout(tp=2, pp=4, ep=32, etp=1)], 8)
    assert [(l.tp, l.pp, l.ep, l.etp, l.cp) for l in fit] == [(2, 4, 2, 1, 1)] and min_world(fit, 8) == 8
    assert notes == ["actor_layout.ep 32 -> 2"]
    fit, notes = reduced_layouts([ParallelLayout(tp=4, pp=2, ep=8, etp=1, cp=4), ParallelLayout(tp=2, pp=2)], 8)
    assert [(l.tp, l.pp, l.ep, l.cp) for l in fit] == [(2, 2, 2, 2), (2, 2, 1, 1)] and min_world(fit, 8) <= 8
    assert notes == ["actor_layout.ep 8 -> 2", "actor_layout.cp 4 -> 2", "actor_layout.tp 4 -> 2"]
    lay = [ParallelLayout(tp=2, ep=8, etp=1)]
    assert reduced_layouts(lay, 8) == (lay, [])
    fit, notes = reduced_layouts([ParallelLayout(tp=2, pp=2)], 2)
    assert fit == [] and notes == ["even at degree 2 the smallest world is 4 ranks"]


def test_run_phase_rehearses_the_397b_at_reduced_expert_parallelism(monkeypatch, tmp_path):
    """The run phase's job config carries the reduced layout (EP 2, TP / PP as the config's) on 8 ranks and the
    report names the reduction; the ranks themselves are not started here (the slow rehearsal runs them)."""
    import json

    import yaml

    import megatron_s3ac.trainer.rehearse_run as rr
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.rehearse import Phase

    got = {}

    def fake(fn, world, pg_timeout, config_path, *a, **k):
        got.setdefault("world", world)
        got.setdefault("layout", yaml.safe_load(open(config_path))["actor_layout"])
        got.setdefault("experts", json.load(open(os.path.join(tmp_path, "job", "shrunk", "config.json")))
                       .get("text_config", {}).get("num_experts"))
        return [{"result": None, "records": [], "error": "RuntimeError: stop here\n"}] + [
            {"result": None, "records": [], "error": None}] * (world - 1)

    monkeypatch.setattr(rr, "run_with_pg_timeout", fake)
    monkeypatch.chdir(ROOT)
    cfg = load_config("examples/qwen3_5/qwen3_5_397b_layout.yaml",
                      ["model.hf_config=examples/hf_configs/qwen3_5_397b_a17b"], check=False)
    p = Phase("run")
    rr.run_phase(cfg, str(tmp_path / "job"), 8, p)
    assert got["world"] == 8
    assert (got["layout"]["tp"], got["layout"]["pp"], got["layout"]["ep"], got["layout"]["etp"]) == (2, 4, 2, 1)
    assert got["experts"] % 2 == 0  # the shrunk model's experts divide over EP 2
    assert p.ran[0].startswith("degrees reduced to fit --max-ranks 8 (the config's layouts need 128 ranks): "
                               "actor_layout.ep 32 -> 2;")


# the groups phase (trainer/rehearse_groups.py): the groups the reduced run phase ran smaller, at their real sizes
MOE8 = MOE + ["cluster.gpus=8"]  # the 30B's TP2 EP8 on 8 GPUs: under --max-ranks 4 the run phase runs EP 4 on 4


def test_group_sizes_and_worlds_by_hand():
    """By hand: the 397B's TP2 PP4 EP32 on 128 ranks has DP 128 / (2 x 4) = 16, expert-DP 128 / (32 x 4) = 1; the
    run phase's TP2 PP4 EP2 on 8 ranks has DP 1, EP 2. One stage is 128 / 4 = 32 ranks and holds EP 32 and DP 16;
    at --max-group-ranks 16 only the DP group fits (16 ranks, the other degrees 1) and EP 32 is named as not
    rehearsed."""
    from megatron_s3ac.models.parallel import ParallelLayout
    from megatron_s3ac.trainer.rehearse_groups import group_sizes, worlds

    lay = ParallelLayout(tp=2, pp=4, ep=32, etp=1)
    assert group_sizes(lay, 128) == dict(tp=2, cp=1, pp=4, dp=16, dp_cp=16, ep=32, etp=1, tp_ep=32, edp=1)
    assert group_sizes(ParallelLayout(tp=2, pp=4, ep=2, etp=1), 8) == dict(tp=2, cp=1, pp=4, dp=1, dp_cp=1, ep=2,
                                                                           etp=1, tp_ep=2, edp=1)
    gaps = ["dp", "dp_cp", "ep", "tp_ep"]
    todo, notes = worlds(lay, 128, gaps, 32)
    assert [(w.size, w.layout.tp, w.layout.pp, w.layout.ep, w.real) for w in todo] == [(32, 2, 1, 32, gaps)]
    assert notes == []
    todo, notes = worlds(lay, 128, gaps, 16)
    assert [(w.size, w.layout.tp, w.layout.ep, w.real) for w in todo] == [(16, 1, 1, ["dp", "dp_cp"])]
    assert notes == [f"{k} (32): not rehearsed: the smallest world holding it at its real size is 32 ranks "
                     f"(> --max-group-ranks 16)" for k in ("expert-parallel",
                                                           "expert-tensor x expert-parallel (the token dispatch)")]


def _groups(monkeypatch, tmp_path, rank_fn=None, timeout_s=60.0):
    import megatron_s3ac.trainer.rehearse_groups as rg
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.rehearse import Phase

    monkeypatch.chdir(ROOT)
    cfg = load_config(MOE8[0], MOE8[1:], check=False)
    p = Phase("groups")
    rg.groups_phase(cfg, str(tmp_path / "groups"), 8, 4, 8, p, rank_fn=rank_fn, timeout_s=timeout_s)
    return p


def test_groups_phase_runs_the_expert_group_at_its_real_size(monkeypatch, tmp_path):
    """The 30B on 8 GPUs under --max-ranks 4: the run phase's EP 4 / DP 2 on 4 ranks; the groups phase starts the
    stage's 8 ranks: EP 8 (128 experts, 16 per rank, top-8, alltoall, R3 replay with the full recompute), DP 4,
    expert-DP 1, each group's size and collectives; the all-to-all's deliveries, the replayed routes and the bytes
    per rank against the planner's share at the real degree all pass."""
    p = _groups(monkeypatch, tmp_path)
    out = "\n".join(p.ran)
    assert p.defects == [], out
    assert "smaller in the run phase: data-parallel 2 (real 4), data x context-parallel (the distributed " \
           "optimizer's) 2 (real 4), expert-parallel 4 (real 8)" in out
    assert "TP 2 CP 1 EP 8 ETP 1 on 8 ranks (one pipeline stage's ranks (world 8 / PP 1)): megatron's MoELayer " \
           "(128 experts, 16 per rank, top-8, alltoall dispatcher, R3 replay, full recompute)" in out
    assert "  expert-parallel: 8 ranks (real size; the run phase: 4)" in out
    assert "  data-parallel: 4 ranks (real size; the run phase: 2)" in out
    assert "all-to-all: every local expert received exactly the tokens its group routed to it" in out
    assert "R3: the router used the replayed routes on every rank (forward and the full recompute)" in out
    rows = {r["kind"]: r for r in p.residency}
    assert rows["params"]["ratio"] == pytest.approx(1.0, abs=0.02) and rows["grads"]["ratio"] == pytest.approx(
        1.0, abs=0.02) and rows["optimizer"]["ratio"] <= 1.02
    assert out.splitlines()[-1] == "  data-parallel, data x context-parallel (the distributed optimizer's), " \
        "expert-parallel, expert-tensor x expert-parallel (the token dispatch) rehearsed at the real size: no defect"


def test_groups_phase_names_a_rank_holding_another_expert_count(monkeypatch, tmp_path):
    """Rank 3 built from a config.json with 8 more experts (17 per EP 8 rank): named, with the planner's share, before
    any collective that would hang on it (tests/gpu_readiness/_groups_faults.py: a light module, as the ranks import
    it)."""
    from tests.gpu_readiness._groups_faults import rank_3_holds_another_expert_count

    p = _groups(monkeypatch, tmp_path, rank_3_holds_another_expert_count)
    assert len(p.defects) == 1, p.defects
    assert p.defects[0].endswith("rank 3 holds 17 local experts (the planner's share at EP 8: 128 / 8 = 16)")


def test_groups_phase_not_needed_when_the_run_phase_keeps_every_degree(monkeypatch, tmp_path):
    import megatron_s3ac.trainer.rehearse_groups as rg
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.rehearse import Phase

    monkeypatch.chdir(ROOT)
    p = Phase("groups")
    rg.groups_phase(load_config(MOE8[0], MOE8[1:], check=False), str(tmp_path), 8, 8, 8, p)
    assert p.ran[0].startswith("not needed: the run phase keeps every degree of the layouts (its world 8 fits "
                               "--max-ranks 8)") and p.defects == []


def test_groups_phase_names_a_rank_issuing_other_collectives(monkeypatch, tmp_path):
    """Rank 5 without the full recompute: its collective sequence on the expert-parallel group leaves the others'
    (they wait in the recompute's all-to-all until the groups' timeout, 20 s here); the audit names the group, both
    ranks and the first collective where they part."""
    from tests.gpu_readiness._groups_faults import rank_5_without_the_recompute

    p = _groups(monkeypatch, tmp_path, rank_5_without_the_recompute, timeout_s=20.0)
    assert len(p.defects) == 1, p.defects
    assert ": the expert-parallel group " in p.defects[0] and "and rank 5 diverge at collective #" in p.defects[0], \
        p.defects[0]


def test_groups_phase_runs_the_397b_stage_at_ep_32(monkeypatch, tmp_path):
    """The 397B (TP2 PP4 EP32 on 128 GPUs; the run phase: EP 2 on 8 ranks): one stage's 32 ranks, EP 32 (512
    experts, 16 per rank, top-10), DP 16; the planner's share of the layer at the real degree exactly (11-27 s here
    on 2 cores, 2.3 GiB at most)."""
    import megatron_s3ac.trainer.rehearse_groups as rg
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.rehearse import Phase

    monkeypatch.chdir(ROOT)
    cfg = load_config("examples/qwen3_5/qwen3_5_397b_layout.yaml",
                      ["model.hf_config=examples/hf_configs/qwen3_5_397b_a17b"], check=False)
    p = Phase("groups")
    rg.groups_phase(cfg, str(tmp_path / "groups"), 128, 8, 32, p)
    out = "\n".join(p.ran)
    assert p.defects == [], out
    assert "megatron's MoELayer (512 experts, 16 per rank, top-10, alltoall dispatcher, R3 replay, full recompute)" \
        in out
    assert "  expert-parallel: 32 ranks (real size; the run phase: 2)" in out
    assert "  data x context-parallel (the distributed optimizer's): 16 ranks (real size; the run phase: 1)" in out
    assert {r["kind"]: r["ratio"] for r in p.residency} == {"params": 1.0, "grads": 1.0, "optimizer": 1.0}
