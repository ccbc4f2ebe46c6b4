"""The rehearsal's ``groups`` phase: the parallel groups the reduced ``run`` phase could not reach, at their real
sizes (trainer/rehearse.py; docs/rehearse.md).

When the cluster's world does not fit ``--max-ranks`` the run phase rehearses the job at reduced degrees
(``rehearse_run.reduced_layouts``: the 397B's EP 32 as EP 2), so some of megatron's groups run smaller than on the
cluster (the expert-parallel group, its expert-tensor-and-expert group, the data-parallel group, the
expert-data-parallel group). This phase starts, for each layout, ONE pipeline stage's worth of ranks (world / PP:
the stage's tensor, context, data and expert groups at their real sizes; PP 1) where that fits
``--max-group-ranks``, else, per group kind, the smallest world holding that group at its real size with the other
degrees at 1 (``worlds``). On every rank, under the collective audit (audit.collectives):

* megatron's process groups for the layout (``models.parallel.initialize_model_parallel``), each group's size
  against the layout's arithmetic;
* one MLP of the model as the trainer builds it (the architecture's layer spec on CPU, ``build_transformer_config``
  with the config's recompute and R3 settings): for an MoE model megatron's real ``MoELayer`` with the real number of
  experts (experts per rank = num_experts / EP), the real router top-k and the config's token dispatcher, at shrunk
  widths (``shrunk_hf``); forward and backward of a few tokens per rank, with the routes replayed (R3's
  ``RouterReplay``: REPLAY_FORWARD, and REPLAY_BACKWARD in the recompute of ``train.recompute: full``) when the
  config uses R3;
* megatron's ``DistributedDataParallel`` as the trainer wraps it (``models.optim.wrap_ddp``: one bucket per buffer,
  overlap off), its gradient reduce (``finalize_model_grads``: the dense grads over the data x context-parallel
  group, the expert grads over the expert-data-parallel group) and one step of the trainer's distributed optimizer.

Checked, each a defect naming the rank: a rank's error; the ranks of a group issuing different collectives; a
group whose size is not the layout's; a rank holding another number of experts than the planner's share
(``plan.params.rank_params``: num_experts / EP) — checked on every rank (one all_gather_object) before the
layer's first collective, so a mismatch ends the ranks at once instead of in a hang; tokens lost or duplicated by the all-to-all (every local
expert receives exactly the tokens the ranks of its expert-parallel group routed to it, for ETP 1); replayed routes
not used by the router (forward or recompute); and the rank's resident params / grads / optimizer bytes above the
planner's per-rank share at the REAL degree (``plan.memory.model_states`` for the same shrunk layer on the real
layout and world, tolerance as the run phase's).

What it cannot see (docs/rehearse.md "What a rehearsal cannot see"): the stage's other modules (attention, the GDN,
the norms, embeddings, the value head: their gradients in the real data-parallel reduce, their context-parallel
exchange), pipeline parallelism (PP 1 here; the run phase runs the real PP at the reduced EP), the stages other than
one (they hold the same groups), the job's steps at the real degree (rollout, weight sync, checkpoint), the widths
(the bytes are the shrunk layer's) and NCCL (gloo).
"""
from __future__ import annotations

import copy
import dataclasses
import os
import time

# the rank processes import this module: nothing heavy at its top (trainer.rehearse_run is imported where used)

# the most ranks one world of this phase starts (--max-group-ranks): measured on this 2-core, 24 GiB machine
# (docs/rehearse.md "The groups phase: feasibility")
MAX_GROUP_RANKS = 32
# the groups' collective timeout: a rank stuck in a divergent collective ends after this (gloo honours it)
GROUP_TIMEOUT_S = 120.0
TOKENS_PER_RANK = 8  # each rank's sequence-parallel share of one micro-batch (b = 1)
SEED = 1234

# group kinds: megatron's groups of one pipeline stage, in report order
KINDS = ("tp", "cp", "dp", "dp_cp", "ep", "etp", "tp_ep", "edp")
EXPERT_KINDS = ("ep", "etp", "tp_ep", "edp")
NAMES = {"tp": "tensor-parallel", "cp": "context-parallel", "dp": "data-parallel",
         "dp_cp": "data x context-parallel (the distributed optimizer's)", "ep": "expert-parallel",
         "etp": "expert-tensor-parallel", "tp_ep": "expert-tensor x expert-parallel (the token dispatch)",
         "edp": "expert-data-parallel", "pp": "pipeline-parallel"}


def group_sizes(layout, world: int) -> dict:
    """{kind: size} of megatron's groups for ``layout`` on ``world`` ranks (parallel_state's arithmetic)."""
    tp, cp, pp, ep, etp = layout.tp, layout.cp, layout.pp, layout.ep, layout.etp
    return {"tp": tp, "cp": cp, "pp": pp, "dp": world // (tp * cp * pp), "dp_cp": world // (tp * pp), "ep": ep,
            "etp": etp, "tp_ep": etp * ep, "edp": world // (etp * ep * pp)}


@dataclasses.dataclass
class World:
    """One world this phase starts: ``layout`` (PP 1) on ``size`` ranks; ``real``: the kinds at their real size."""

    layout: object
    size: int
    real: list
    why: str


def worlds(layout, world: int, gaps: list, max_group_ranks: int) -> tuple[list, list]:
    """(worlds to start, notes on the gaps no world can hold): one pipeline stage (``world / pp`` ranks, every group
    of a stage at its real size) if it fits, else per gap kind the smallest world holding it at its real size
    with the other degrees at 1 (MoE: the expert groups on ``etp x ep`` ranks; the data-parallel group on ``dp``
    ranks; the expert-data-parallel group on ``edp`` ranks; TP on ``tp``), a kind already real in an earlier world
    not again."""
    real = group_sizes(layout, world)
    stage = dataclasses.replace(layout, pp=1, first_stage_layers=None, last_stage_layers=None)
    notes = [f"{NAMES[k]} ({real[k]}): not rehearsed here: pipeline parallelism needs the other stages; the run "
             f"phase runs it at its real degree" for k in gaps if k == "pp"]
    gaps = [k for k in gaps if k != "pp"]
    size = world // layout.pp
    if size <= max_group_ranks:
        w = World(stage, size, [k for k in gaps if group_sizes(stage, size)[k] == real[k]],
                  f"one pipeline stage's ranks (world {world} / PP {layout.pp})")
        return [w], notes
    one = dict(tp=1, cp=1, pp=1, ep=1, etp=1, first_stage_layers=None, last_stage_layers=None)
    options = {
        "ep": (dict(ep=layout.ep, etp=layout.etp), layout.ep * layout.etp),
        "tp_ep": (dict(ep=layout.ep, etp=layout.etp), layout.ep * layout.etp),
        "etp": (dict(ep=layout.ep, etp=layout.etp), layout.ep * layout.etp),
        "dp": ({}, real["dp"]),
        "dp_cp": ({}, real["dp_cp"]),
        "edp": ({}, real["edp"]),
        "tp": (dict(tp=layout.tp, etp=layout.tp if layout.ep == 1 else 1), layout.tp),
        "cp": (dict(cp=layout.cp), layout.cp),
    }
    out, covered = [], set()
    for k in gaps:
        if k in covered:
            continue
        kw, n = options[k]
        if k == "cp":
            notes.append(f"{NAMES[k]} ({real[k]}): not rehearsed here: its modules are attention's and the "
                         f"Gated DeltaNet's, which this phase does not build")
            continue
        if n > max_group_ranks:
            notes.append(f"{NAMES[k]} ({real[k]}): not rehearsed: the smallest world holding it at its real size "
                         f"is {n} ranks (> --max-group-ranks {max_group_ranks})")
            continue
        lay = dataclasses.replace(layout, **{**one, **kw})
        got = group_sizes(lay, n)
        held = [g for g in gaps if got[g] == real[g] and g not in covered]
        covered.update(held)
        out.append(World(lay, n, held, f"the smallest world holding the {NAMES[k]} group at {real[k]} "
                                        f"(the other degrees 1)"))
    return out, notes


def shrunk_hf(hf: dict, layout) -> dict:
    """The model's config.json with small widths and the real expert count and top-k: heads / kv heads divisible by
    TP, the FFN widths by TP and ETP, a few layers (Qwen3.5's 3 GDN + 1 attention pattern), a small vocab."""
    out = copy.deepcopy(hf)
    text = out["text_config"] if isinstance(out.get("text_config"), dict) else out
    tp, etp = layout.tp, layout.etp or 1
    kv = max(2, tp)
    text.update(hidden_size=32, num_attention_heads=2 * kv, num_key_value_heads=kv, head_dim=8, vocab_size=64,
                num_hidden_layers=4 if out["model_type"].startswith("qwen3_5") else 2)
    if "intermediate_size" in text:
        text["intermediate_size"] = 8 * tp
    if "moe_intermediate_size" in text:
        text["moe_intermediate_size"] = 8 * etp
    if text.get("shared_expert_intermediate_size"):
        text["shared_expert_intermediate_size"] = 8 * tp
    if "linear_num_key_heads" in text:
        text.update(linear_num_key_heads=kv, linear_num_value_heads=2 * kv, linear_key_head_dim=8,
                    linear_value_head_dim=8)
    for key in ("layer_types", "mlp_only_layers"):
        text.pop(key, None)  # sized by the real layer count
    return out


def _mlp_spec(config, info):
    """(global layer index, ModuleSpec) of the first layer's MLP the arch builds on CPU (an MoE layer if any)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_s3ac.models.registry import get_arch

    block = get_arch(info.model_type).block_spec(config, info, False, pp_rank=0)
    layers = getattr(block, "layer_specs", None) or [block]
    for i, spec in enumerate(layers):
        mlp = spec.submodules.mlp
        if getattr(mlp, "module", None) is MoELayer or getattr(mlp, "func", None) is MoELayer:  # spec / builder
            return i, mlp
    return 0, layers[0].submodules.mlp


def _build_mlp(mlp, config, pg):
    """The layer's MLP built as megatron-core 0.19.2's TransformerLayer builds it (transformer_layer.py:419-438): the
    spec's ``mlp`` is a builder (``partial(MoELayer, submodules=...)``, moe_module_specs.py:87-89) called with the
    config and the process groups; a dense ``ModuleSpec(MLP)`` is rewrapped through ``MLP.as_mlp_submodule``."""
    import functools

    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(mlp, ModuleSpec):
        mlp = functools.partial(mlp.module.as_mlp_submodule, submodules=mlp.submodules, **mlp.params)
    return mlp(config=config, pg_collection=pg, is_mtp_layer=False)


def _groups() -> dict:
    """{kind: (group name, its global ranks)} of this rank's megatron groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    get = {"tp": ps.get_tensor_model_parallel_group, "cp": ps.get_context_parallel_group,
           "dp": lambda: ps.get_data_parallel_group(with_context_parallel=False),
           "dp_cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
           "ep": ps.get_expert_model_parallel_group, "etp": ps.get_expert_tensor_parallel_group,
           "tp_ep": ps.get_expert_tensor_and_model_parallel_group, "edp": ps.get_expert_data_parallel_group}
    out = {}
    for k, f in get.items():
        g = f()
        ranks = tuple(dist.get_process_group_ranks(g))
        out[k] = (str(getattr(g, "group_name", None) or ranks), ranks)
    return out


class SharesMismatch(AssertionError):
    """A rank's module holds another share than the planner's at this degree."""


def _rank(spec: dict) -> dict:
    """Rank body (audit.pg_timeout.run_with_pg_timeout): ``_body`` under the collective audit, the rank's output to
    ``groups.rank<r>.log`` in ``spec['dir']``."""
    import sys

    import torch.distributed as dist

    from megatron_s3ac.console import silence_known_warnings

    log = os.path.join(spec["dir"], f"groups.rank{dist.get_rank()}.log")
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    silence_known_warnings()
    from megatron_s3ac.audit.collectives import audited

    out = audited(_body, spec)
    out["groups"] = _BUILT.get("groups")  # kept when the body failed: the parent names a divergent group's kind
    return out


_BUILT: dict = {}  # this rank's megatron groups once made (``_groups``)


def _body(spec: dict) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import tensor_parallel
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from megatron_s3ac.audit.residency import resident_bytes
    from megatron_s3ac.models.actor_critic import build_transformer_config
    from megatron_s3ac.models.optim import build_optimizer, wrap_ddp
    from megatron_s3ac.models.parallel import ParallelLayout, initialize_model_parallel
    from megatron_s3ac.models.registry import model_info

    t0 = time.monotonic()
    rank = dist.get_rank()
    layout = ParallelLayout(**spec["layout"])
    initialize_model_parallel(layout, seed=SEED, timeout_s=spec["timeout_s"])
    groups = _BUILT["groups"] = _groups()
    t_groups = time.monotonic()
    info = model_info(spec["hf"])
    config = build_transformer_config(info, layout, dtype=torch.float32, **spec["recompute"], **spec["r3"])
    layer, mlp = _mlp_spec(config, info)
    pg = get_default_pg_collection()
    module = _build_mlp(mlp, config, pg)
    if hasattr(module, "set_layer_number"):
        module.set_layer_number(layer + 1)
    moe = isinstance(module, MoELayer)
    facts = {"rank": rank, "experts": module.num_local_experts if moe else 0,
             "first_expert": module.local_expert_indices[0] if moe else 0,
             "params": sum(p.numel() for p in module.parameters())}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, facts)  # every rank sees every share before any collective that could hang on it
    want = spec["experts_per_rank"]
    bad = [f for f in every if moe and f["experts"] != want]
    if bad:
        raise SharesMismatch("; ".join(f"rank {f['rank']} holds {f['experts']} local experts (the planner's share "
                                       f"at EP {layout.ep}: {spec['num_experts']} / {layout.ep} = {want})"
                                       for f in bad))
    ddp = wrap_ddp(module, config)
    opt = build_optimizer([ddp], lr=1e-4, **spec["optim"])
    torch.manual_seed(SEED + rank)
    x = torch.randn(TOKENS_PER_RANK, 1, info.hidden_size, requires_grad=True)
    routes, seen, received = None, [], []
    hooks = []
    if moe:
        hooks.append(module.router.register_forward_hook(lambda m, a, out: seen.append(out[1].clone())))
        hooks.append(module.experts.register_forward_pre_hook(
            lambda m, a: received.append(torch.as_tensor(a[1]).clone())))
        if spec["r3_on"]:  # the rollout's routes: distinct experts per token, this rank's own tokens
            routes = torch.rand(TOKENS_PER_RANK, info.num_experts).topk(info.top_k, dim=1).indices
            module.router.router_replay.set_target_indices(routes)
            module.router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    t_built = time.monotonic()
    if spec["recompute"]["recompute"] == "full":  # the block's full recompute: the layer re-runs in backward
        out = tensor_parallel.checkpoint(lambda h: ddp(h)[0], False, x)
    else:
        out = ddp(x)[0]
    if routes is not None:  # as r3.replay's post-hook: the recompute pops the FIFO
        module.router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
    (out.float() ** 2).mean().backward()
    config.finalize_model_grads_func([ddp])  # the DDP reduce: dense grads over DP x CP, experts' over expert-DP
    ok, _, _ = opt.step()
    t_step = time.monotonic()
    for h in hooks:
        h.remove()
    if moe:
        module.router.router_replay.clear_indices()
        module.router.router_replay.clear_router_replay_action()
    resident = resident_bytes([ddp], opt, next(ddp.parameters()).device)
    buffers = [{"expert": i >= len(ddp.buffers), "group": str(getattr(b.data_parallel_group, "group_name", "")),
                "group_size": b.data_parallel_group.size(),
                "buckets": [int(k.grad_data.numel()) for k in b.buckets]}
               for i, b in enumerate(ddp.buffers + ddp.expert_parallel_buffers)]
    res = {"groups": groups, "facts": facts, "resident": resident, "buffers": buffers, "step_ok": bool(ok),
           "seconds": {"groups": t_groups - t0, "build": t_built - t_groups, "step": t_step - t_built}}
    if moe:
        res["local_experts"] = list(module.local_expert_indices)
        res["received"] = [int(v) for v in received[0].tolist()] if received else []
        res["routes"] = routes.tolist() if routes is not None else None
        # the experts each token went to, per pass (forward; the recompute's with full recompute)
        res["maps"] = [[sorted(m[t].nonzero().flatten().tolist()) for t in range(m.shape[0])] for m in seen]
        res["bincount"] = torch.bincount(seen[0].nonzero()[:, 1], minlength=info.num_experts).tolist() if seen \
            else []
    return res


def planned_share(info, layout, world: int, knobs, layer: int) -> tuple[dict, object]:
    """({params, grads, optimizer} bytes, StageParams) of the planner's per-rank share of layer ``layer``'s MLP
    tensors (``mlp.*``: router, experts, shared expert and its gate; not the pre-MLP norm) at ``layout`` on
    ``world`` ranks (plan.params.rank_params sharding, plan.memory.model_states padding)."""
    from megatron_s3ac.plan.memory import model_states

    from megatron_s3ac.plan.params import rank_params

    def keep(t):  # the MLP's own tensors (per layer or stacked [L, ...]); a pre-MLP norm named as TE fuses it
        mlp = f"decoder.layers.{layer}.mlp." in t.key or t.key.startswith("decoder.layers.mlp.")  # into fc1: the layer's
        return mlp and not t.key.endswith("layer_norm_weight")

    sp = rank_params(info, layout, keep=keep, layers={layer})
    st = next(s for s in sp if layer in s.layers)
    states = model_states(st, layout, world, knobs)
    return {"params": states.params, "grads": states.grads, "optimizer": states.optimizer}, st


def _ops(records, name: str) -> str:
    counts: dict = {}
    for r in records:
        if r.group == name:
            counts[r.op] = counts.get(r.op, 0) + 1
    return ", ".join(f"{op} x{n}" for op, n in counts.items()) or "none"


def run_world(cfg, w: World, real_layout, real_world: int, reached: dict, tmp: str, p, rank_fn=None,
              timeout_s: float = GROUP_TIMEOUT_S) -> None:
    """Start world ``w``, check it (the module docstring's list) and add what it did and its defects to ``p``."""
    from megatron_s3ac.audit.collectives import CollectiveDivergence, check_consistent
    from megatron_s3ac.audit.pg_timeout import run_with_pg_timeout
    from megatron_s3ac.audit.residency import compare
    from megatron_s3ac.models.gloo_ranks import DistributedTestError
    from megatron_s3ac.models.registry import load_hf_config, model_info
    from megatron_s3ac.plan.preflight import trainer_knobs
    from megatron_s3ac.r3.glue import r3_setting
    from megatron_s3ac.trainer.rehearse_run import RESIDENCY_TOLERANCE, _tail, _where
    from megatron_s3ac.trainer.step.build import _config_kw

    os.makedirs(tmp, exist_ok=True)
    hf = shrunk_hf(load_hf_config(cfg.model.hf_config), real_layout)
    info = model_info(hf)
    r3, r3_on = r3_setting(cfg.train.r3, cfg.train.r3_agreement_every, info)
    kw = _config_kw(cfg)
    kw.pop("dtype")
    o = cfg.optim.actor
    knobs = trainer_knobs(cfg)
    knobs.dtype, knobs.optimizer_offload = "fp32", 0.0  # as the ranks run it: fp32, the optimizer on the device
    spec = {"dir": tmp, "layout": dataclasses.asdict(w.layout), "hf": hf, "timeout_s": timeout_s,
            "recompute": kw, "r3": r3.transformer_config_overrides(info) if r3_on else {}, "r3_on": r3_on,
            "optim": dict(cpu_offload=False, precision_aware=bool(o.precision_aware)),
            "experts_per_rank": info.num_experts // w.layout.ep if info.is_moe else 0, "num_experts": info.num_experts}
    sizes, real = group_sizes(w.layout, w.size), group_sizes(real_layout, real_world)
    lay = w.layout
    what = (f"TP {lay.tp} CP {lay.cp} EP {lay.ep} ETP {lay.etp} on {w.size} ranks ({w.why})")
    kind = (f"megatron's MoELayer ({info.num_experts} experts, {spec['experts_per_rank']} per rank, top-"
            f"{info.top_k}, {cfg_dispatcher(info)} dispatcher{', R3 replay' if r3_on else ''}"
            f"{', full recompute' if kw['recompute'] == 'full' else ''})" if info.is_moe else "the layer's MLP")
    p.ran.append(f"{what}: {kind} at hidden {info.hidden_size}, {TOKENS_PER_RANK} tokens per rank, forward + "
                 f"backward, the DDP gradient reduce (wrap_ddp: overlap off, one bucket per buffer) and one "
                 f"distributed-optimizer step, every rank under the collective audit")
    t0 = time.monotonic()
    try:
        res = run_with_pg_timeout(rank_fn or _rank, w.size, timeout_s, spec, timeout=timeout_s + 300.0)
    except DistributedTestError as e:
        p.defects.append(f"{what}: {str(e).strip().splitlines()[-1]}")
        return
    wall = time.monotonic() - t0
    records = [x["records"] for x in res]
    try:  # the divergence first: it is the better message than the timeout or error it causes
        n = check_consistent(records)
    except CollectiveDivergence as e:
        kinds: dict = {}  # group name -> its kinds (one group can be two kinds, e.g. DP and DP x CP at CP 1)
        for x in res:
            for k, (name, _) in (x.get("groups") or {}).items():
                if NAMES[k] not in kinds.setdefault(name, []):
                    kinds[name].append(NAMES[k])
        msg = str(e)
        name = msg.split(" ", 2)[1] if msg.startswith("group ") else None
        if name in kinds:
            msg = f"the {' / '.join(kinds[name])} group {msg[len('group '):]}"
        p.defects.append(f"{what}: {msg}")
        return
    errors = [(r, x["error"]) for r, x in enumerate(res) if x["error"]]
    if errors:
        r, err = errors[0]
        last = err.strip().splitlines()[-1]
        p.tracebacks.append(err)
        if f"{SharesMismatch.__name__}: " in last:  # every rank raised it, naming the ranks that differ
            p.defects.append(f"{what}: {last.split(f'{SharesMismatch.__name__}: ', 1)[1]}")
            return
        p.defects.append(f"{what}: rank {r}: {last} (at {_where(err)})")
        p.ran += [f"rank {r}'s log: {line}" for line in _tail(os.path.join(tmp, f"groups.rank{r}.log"))]
        return
    out = [x["result"] for x in res]
    secs = {k: max(o["seconds"][k] for o in out) for k in out[0]["seconds"]}
    p.ran.append(f"{w.size} ranks in {wall:.0f} s (groups {secs['groups']:.0f} s, build {secs['build']:.0f} s, "
                 f"forward + backward + reduce + step {secs['step']:.0f} s, the slowest rank each); {n} collectives, "
                 f"every group's ranks in step")
    d0 = len(p.defects)
    # each group's size and what it carried
    for k in KINDS:
        for r, o in enumerate(out):
            got = len(o["groups"][k][1])
            if got != sizes[k]:
                p.defects.append(f"{what}: rank {r}'s {NAMES[k]} group has {got} ranks, the layout's is {sizes[k]}")
                break
    for k in [k for k in KINDS if info.is_moe or k not in EXPERT_KINDS]:
        name, ranks = out[0]["groups"][k]
        at = "real size" if sizes[k] == real[k] else f"the cluster's is {real[k]}"
        was = f"; the run phase: {reached[k]}" if reached.get(k) is not None and reached[k] != sizes[k] else ""
        p.ran.append(f"  {NAMES[k]}: {sizes[k]} rank{'s' if sizes[k] != 1 else ''} ({at}{was}); rank 0's "
                     f"collectives on it: {_ops(records[0], name)}")
    if info.is_moe:
        _moe_checks(out, w, info, what, r3_on, kw["recompute"] == "full", p)
    # per-rank bytes against the planner's share at the REAL degree
    planned, st = planned_share(info, real_layout, real_world, knobs, _first_moe_layer(info))
    worst = {k: max(o["resident"][k] for o in out) for k in ("params", "grads", "optimizer")}
    rows, defects = compare({"update": {"layer": worst}}, {"update": {"layer": planned}}, RESIDENCY_TOLERANCE, what)
    p.residency += [dict(r, phase="groups", world=w.size) for r in rows]
    p.ran.append("  resident per rank (the most over the ranks) / the planner's share at the real degree "
                 f"(plan.memory.model_states of this layer at TP {real_layout.tp} PP {real_layout.pp} EP "
                 f"{real_layout.ep} on {real_world} ranks: DP {real['dp_cp']}, expert-DP {real['edp']}): " + ", ".join(
                     f"{r['kind']} {r['measured']:,} / {r['planned']:,} B "
                     f"({'x' if r['ratio'] is None else format(r['ratio'], '.3f')})" for r in rows))
    p.defects += [d.replace(": update: the layer's", ": the layer's") for d in defects]
    bufs = out[0]["buffers"]
    p.ran.append("  DDP buffers (rank 0): " + "; ".join(
        f"{'expert' if b['expert'] else 'dense'} over {b['group_size']} ranks, {len(b['buckets'])} bucket(s) of "
        f"{', '.join(format(x, ',') for x in b['buckets'])} elements" for b in bufs)
        + f" (the planner pads: dense {_pad_note(st.dense_numels, real['dp_cp'])}, expert "
          f"{_pad_note(st.expert_numels, real['edp'])})")
    if len(p.defects) == d0:
        p.ran.append(f"  {', '.join(NAMES[k] for k in w.real) or 'no group'} rehearsed at the real size: no defect")


def _pad_note(numels, dp: int) -> str:
    from megatron_s3ac.plan.memory import buffer_numel

    return format(buffer_numel(list(numels), dp), ",")


def cfg_dispatcher(info) -> str:
    from megatron_s3ac.models.registry import get_arch

    return get_arch(info.model_type).transformer_config_kwargs(info).get("moe_token_dispatcher_type", "alltoall")


def _first_moe_layer(info) -> int:
    return min(info.moe_layers) if info.moe_layers else 0


def _moe_checks(out, w: World, info, what: str, r3_on: bool, recompute: bool, p) -> None:
    """Experts per rank, the all-to-all's delivery (ETP 1) and R3's replay, on every rank."""
    want = info.num_experts // w.layout.ep
    for o in out:
        if len(o["local_experts"]) != want:
            p.defects.append(f"{what}: rank {o['facts']['rank']} holds {len(o['local_experts'])} experts, "
                             f"the planner's share is {want}")
            return
    if w.layout.etp == 1:
        by_group: dict = {}
        for r, o in enumerate(out):
            by_group.setdefault(tuple(o["groups"]["tp_ep"][1]), []).append(r)
        for members in by_group.values():
            total = [sum(out[m]["bincount"][e] for m in members) for e in range(info.num_experts)]
            for m in members:
                got, local = out[m]["received"], out[m]["local_experts"]
                expect = [total[e] for e in local]
                if got != expect:
                    bad = next(i for i in range(len(local)) if got[i] != expect[i])
                    p.defects.append(f"{what}: rank {m}'s expert {local[bad]} received {got[bad]} tokens, the ranks "
                                     f"of its expert-parallel group routed {expect[bad]} to it (the all-to-all "
                                     f"lost or duplicated tokens)")
                    return
        routed = sum(sum(o["bincount"]) for o in out)
        p.ran.append(f"  all-to-all: every local expert received exactly the tokens its group routed to it "
                     f"({routed:,} token-expert pairs over {info.num_experts} experts, {want} per rank)")
    if r3_on:
        for r, o in enumerate(out):
            replay = [sorted(x) for x in o["routes"]]
            for i, m in enumerate(o["maps"]):
                if m != replay:
                    which = "the recompute in backward" if i else "the forward"
                    p.defects.append(f"{what}: rank {r}: {which} routed other experts than the replayed routes "
                                     f"(R3: RouterReplay not honoured)")
                    return
        passes = "forward and the full recompute" if recompute else "forward"
        p.ran.append(f"  R3: the router used the replayed routes on every rank ({passes})")


def groups_phase(cfg, tmp: str, world: int, max_ranks: int, max_group_ranks: int, p, rank_fn=None,
                 timeout_s: float = GROUP_TIMEOUT_S) -> None:
    """Add to phase ``p`` the groups the reduced run phase did not reach, rehearsed at their real sizes."""
    from megatron_s3ac.config import layout_of
    from megatron_s3ac.models.registry import model_info
    from megatron_s3ac.trainer.rehearse_run import min_world, reduced_layouts

    named = [("actor_layout", layout_of(cfg.actor_layout))]
    if cfg.critic_layout:
        named.append(("critic_layout", layout_of(cfg.critic_layout)))
    layouts = [l for _, l in named]
    moe = model_info(cfg.model.hf_config).is_moe  # a dense model has no expert groups
    need = min_world(layouts, max_ranks)
    if need <= max_ranks:
        p.ran.append(f"not needed: the run phase keeps every degree of the layouts (its world {need} fits "
                     f"--max-ranks {max_ranks}); its data-parallel groups are smaller than the cluster's (DP of the "
                     f"run: 1 or 2), which this phase rehearses only for reduced worlds")
        return
    fit, _ = reduced_layouts(layouts, max_ranks)
    w_r = min_world(fit, max_ranks) if fit else 0
    seen = []
    for i, (name, layout) in enumerate(named):
        if layout in seen:
            continue
        seen.append(layout)
        real = group_sizes(layout, world)
        reached = group_sizes(fit[i], w_r) if fit else {k: 0 for k in real}
        gaps = [k for k in ("pp",) + KINDS if real[k] > reached[k] and (moe or k not in EXPERT_KINDS)]
        if not gaps:
            p.ran.append(f"{name}: the run phase reached every group at its real size")
            continue
        p.ran.append(f"{name} (TP {layout.tp} PP {layout.pp} CP {layout.cp} EP {layout.ep} ETP {layout.etp} on "
                     f"{world} ranks): smaller in the run phase: " + ", ".join(
                         f"{NAMES[k]} {reached[k]} (real {real[k]})" for k in gaps))
        todo, notes = worlds(layout, world, gaps, max_group_ranks)
        p.ran += [f"  {x}" for x in notes]
        for j, w in enumerate(todo):
            run_world(cfg, w, layout, world, reached, os.path.join(tmp, f"{name}{j}"), p, rank_fn, timeout_s)
        held = {k for w in todo for k in w.real}
        missing = [k for k in gaps if k not in held and k != "pp"]
        if missing:
            p.ran.append(f"  not rehearsed at the real size: {', '.join(f'{NAMES[k]} ({real[k]})' for k in missing)}")
