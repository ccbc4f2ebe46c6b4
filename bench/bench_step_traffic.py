"""Bytes sent and received per rank in one trainer step, before vs after the sharded data flow.

4 gloo ranks (torchrun), the real ``Trainer`` (tiny Qwen3-MoE, S3AC with critic, R3 on, 32 prompts x
K=4 = 128 rows, DAPO filter off so every row is trained) at two layouts:
  DP=4   actor_layout.ep=2 (EP lives inside DP)
  DP=2   actor_layout.pp=2 actor_layout.ep=2 (the routes of a row are cut to its stage's 1 MoE layer)
"before" runs the same bench against another tree of the project (default: ``git archive`` of
--before-rev, the commit before the sharded flow), "after" against this one.

Counting: during ``Trainer.step()`` (step 0; construction and its initial weight sync excluded) every
torch.distributed call is wrapped (a counting shim, here only) at the tensor level, so object
collectives (broadcast_object_list, send_object_list, ...) are counted through the tensor calls they
make. Logical bytes per rank, group size n: broadcast: the source sends (n-1) x bytes, each other rank
receives them once; all_reduce: ring, 2 (n-1)/n x bytes each way; all_gather: (n-1) x the input each
way; reduce_scatter: (n-1)/n x the input; send / recv / isend / irecv: the tensor. Every call is
attributed to the first megatron_s3ac file on its stack:
  rollout bcast  trainer/step/rollout_phases.py: before, the whole batch (samples, routes) broadcast to
                 every rank; after, only the samples' metadata (pid, reward, lengths, finish reason)
  rollout rows   trainer/step/scatter.py: after, each rank's own rows (rank 0 -> class sources -> peers)
  fwd outputs    trainer/step/minibatch.py forward_only, trainer/step/metrics.py, shard_metrics.py, loop.py, r3/
                 (old log-probs, values, metric reductions, micro-batch counts)
  model          megatron-core's own calls (gradient reductions, optimizer, EP all-to-alls, PP
                 activations) and the rest of the project (the weight sync to the engine)

Run: .venv/bin/python bench/bench_step_traffic.py [--before-rev a487c5e~1] [--before-tree DIR]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LAYOUTS = {"DP=4": ["actor_layout.ep=2"], "DP=2": ["actor_layout.pp=2", "actor_layout.ep=2"]}
CONFIG = ["model.tiny=arithmetic_moe", "rollout.prompts_per_step=32", "rollout.k=4", "rollout.max_new_tokens=4",
          "data.num_prompts=400", "data.eval_prompts=16", "algo.actor_minibatches=4", "algo.critic_minibatches=4",
          "algo.dynamic_sampling=false", "daps.enabled=false", "train.eval_every=0", "train.progress=false",
          "train.tensorboard=false"]
CATEGORY = {"rollout_phases.py": "rollout bcast", "scatter.py": "rollout rows", "minibatch.py": "fwd outputs",
            "metrics.py": "fwd outputs", "shard_metrics.py": "fwd outputs", "trainer.py": "fwd outputs",
            "glue.py": "fwd outputs"}


# ---- the counting shim (inside each rank) ------------------------------------------------------------
class Counter:
    def __init__(self):
        self.on = False
        self.sent = collections.Counter()
        self.recv = collections.Counter()

    def category(self) -> str:
        f = sys._getframe(2)
        while f is not None:  # the innermost project or megatron-core frame decides
            name = f.f_code.co_filename
            if "/megatron/" in name:
                return "model"
            if "megatron_s3ac" in name and "bench_step_traffic" not in name:
                return CATEGORY.get(os.path.basename(name), "model")
            f = f.f_back
        return "model"

    def add(self, sent: float, recv: float) -> None:
        if self.on:
            c = self.category()
            self.sent[c] += sent
            self.recv[c] += recv


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def install(counter: Counter) -> None:
    """Wrap the tensor-level torch.distributed calls (module attributes in both namespaces: the
    object collectives call distributed_c10d's globals)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    def size(group):
        return dist.get_world_size(group) if group is not None else dist.get_world_size()

    def me_src(kw, args, group):
        src = kw.get("src", args[0] if args else None)
        gsrc = kw.get("group_src")
        if src is None and gsrc is not None:
            src = dist.get_global_rank(group, gsrc)
        return dist.get_rank() == src

    rules = {
        "broadcast": lambda t, *a, group=None, **kw: (
            (_nbytes(t) * (size(group) - 1), 0) if me_src(kw, a, group) else (0, _nbytes(t))),
        "all_reduce": lambda t, *a, group=None, **kw: (2 * (size(group) - 1) / size(group) * _nbytes(t),) * 2,
        "all_gather": lambda out, t, *a, group=None, **kw: ((size(group) - 1) * _nbytes(t),) * 2,
        "all_gather_into_tensor": lambda out, t, *a, group=None, **kw: ((size(group) - 1) * _nbytes(t),) * 2,
        "_all_gather_base": lambda out, t, *a, group=None, **kw: ((size(group) - 1) * _nbytes(t),) * 2,
        "reduce_scatter_tensor": lambda out, t, *a, group=None, **kw: ((size(group) - 1) / size(group) * _nbytes(t),) * 2,
        "_reduce_scatter_base": lambda out, t, *a, group=None, **kw: ((size(group) - 1) / size(group) * _nbytes(t),) * 2,
        "all_to_all_single": lambda out, t, *a, group=None, **kw: ((size(group) - 1) / size(group) * _nbytes(t),
                                                                  (size(group) - 1) / size(group) * _nbytes(out)),
        "send": lambda t, *a, **kw: (_nbytes(t), 0),
        "isend": lambda t, *a, **kw: (_nbytes(t), 0),
        "recv": lambda t, *a, **kw: (0, _nbytes(t)),
        "irecv": lambda t, *a, **kw: (0, _nbytes(t)),
        "scatter": lambda t, scatter_list=None, *a, **kw: (
            (sum(_nbytes(x) for x in scatter_list) - _nbytes(t), 0) if scatter_list else (0, _nbytes(t))),
    }

    def wrap(name, real, rule):
        def counted(*args, **kwargs):
            try:
                counter.add(*rule(*args, **kwargs))
            except Exception:  # never let counting break the run; say so
                traceback.print_exc()
            return real(*args, **kwargs)
        counted._counted = True
        return counted

    for name, rule in rules.items():  # one wrapper per function, in both namespaces (P2POp checks identity)
        real = getattr(c10d, name, None) or getattr(dist, name, None)
        if real is None or getattr(real, "_counted", False):
            continue
        counted = wrap(name, real, rule)
        for mod in (c10d, dist):
            if getattr(mod, name, None) is real:
                setattr(mod, name, counted)
    # batch_isend_irecv runs each P2POp's op: megatron builds them from torch.distributed.isend / irecv
    # at call time, i.e. the counted wrappers above (each op counted once there)


def rank_main(out: str, overrides: list[str]) -> None:
    """One torchrun rank: build the trainer, count one step, write this rank's bytes."""
    import torch.distributed as dist

    counter = Counter()
    install(counter)
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.step.trainer import Trainer

    tr = Trainer(load_config(None, CONFIG + overrides + [f"train.out_dir={out}/run"]))
    if hasattr(tr, "rank_roles"):  # the sharded flow gathers every rank's layout once per run: not a step cost
        tr.rank_roles()
    dist.barrier()
    counter.on = True
    m = tr.step()
    counter.on = False
    rows = 32 * 4
    res = {"rank": dist.get_rank(), "sent": dict(counter.sent), "recv": dict(counter.recv), "rows": rows,
           "actor_opt_steps": m.get("actor/opt_steps")}
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(res, f)
    tr.close()


# ---- the driver ------------------------------------------------------------------------------------
def _before_tree(rev: str) -> str:
    d = tempfile.mkdtemp(prefix="s3ac_before_")
    tar = subprocess.run(["git", "-C", ROOT, "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", d], input=tar, check=True)
    return d


def _run(tree: str, layout: list[str], out: str, port: int) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc-per-node", "4", "--master-port", str(port), os.path.abspath(__file__),
           "--rank-worker", out, "--", *layout]
    p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if p.returncode:
        sys.stderr.write(p.stdout[-3000:] + p.stderr[-6000:])
        raise SystemExit(f"bench run failed ({tree}, {layout})")
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(4)]


def _mb(x: float) -> str:
    return f"{x / 2**20:8.3f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before-rev", default="a487c5e~1", help="git revision of the broadcast data flow")
    ap.add_argument("--before-tree", default=None, help="a checked-out tree instead of --before-rev")
    ap.add_argument("--rank-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if args.rank_worker:
        rank_main(args.rank_worker, args.overrides)
        return 0
    trees = {"before": args.before_tree or _before_tree(args.before_rev), "after": ROOT}
    res = {}
    port = 29700
    for name, layout in LAYOUTS.items():
        for when, tree in trees.items():
            out = tempfile.mkdtemp(prefix=f"traffic_{when}_")
            port += 1
            res[(name, when)] = _run(tree, layout, out, port)
    cats = ["rollout bcast", "rollout rows", "fwd outputs", "model"]
    print("MiB per rank in one step (sent / received); 4 gloo ranks, 128 rows, S3AC + R3")
    print(f"{'layout':6} {'flow':6} {'rank':4} " + " ".join(f"{c + ' sent':>18} {c + ' recv':>18}" for c in cats))
    for (name, when), ranks in res.items():
        for r in ranks:
            print(f"{name:6} {when:6} {r['rank']:4} " + " ".join(
                f"{_mb(r['sent'].get(c, 0)):>18} {_mb(r['recv'].get(c, 0)):>18}" for c in cats))
    data = ("rollout bcast", "rollout rows", "fwd outputs")
    sent0 = {k: sum(v[0]["sent"].get(c, 0) for c in data) for k, v in res.items()}
    print("\nrank 0 sent, rollout + forward outputs (MiB):")
    for when in trees:
        a, b = sent0[("DP=2", when)], sent0[("DP=4", when)]
        print(f"  {when:6}  DP=2 {_mb(a)}  DP=4 {_mb(b)}  DP=4 / DP=2 = {b / max(a, 1):.2f}")
    print("\nrows received per rank after / (whole batch received before / DP) (1.0 = exactly its share; "
          "a PP stage's routes are also cut to its layers), + the metadata broadcast (KiB):")
    for name in LAYOUTS:
        dp = int(name.split("=")[1])
        before = max(r["recv"].get("rollout bcast", 0) for r in res[(name, "before")])
        parts = []
        for r in res[(name, "after")]:
            rows, meta = r["recv"].get("rollout rows", 0), r["recv"].get("rollout bcast", 0)
            parts.append(f"rank {r['rank']} {rows / (before / dp):.3f} + {meta / 1024:.1f} KiB"
                         + (" (its own rows stay)" if r["rank"] == 0 else ""))
        print(f"  {name}: " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
