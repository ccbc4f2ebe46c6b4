"""Eager DAPO refill (``algo.refill_eager``; docs/trainer.md "Asynchronous rollout", item DAPO): a replacement goes to
the engine as soon as a streamed group is scored uninformative, the kept batch is independent of arrival order,
the drawn-group bound holds, and the config rules. A stand-in engine streams groups lazily in a chosen order and
logs what it is asked and what it hands back, so the order of events is visible."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_s3ac.config.rollout import RolloutLengthTailCfg
from megatron_s3ac.data.prompts import Prompt
from megatron_s3ac.rollout.base import Sample, StreamingGeneration
from megatron_s3ac.trainer.step.rollout_phases import RolloutPhases

K = 4


class StandInEngine:
    """Streams each call's groups lazily in ``order`` ("fifo", "reverse" or a seed for a random permutation);
    a group's samples depend on its prompt and the call's seed only. ``log``: ("submit", prompt ids, seed) and
    ("yield", prompt id, seed) in the order they happen."""

    def __init__(self, order="fifo"):
        self.order, self.log = order, []

    def generate_stream_async(self, prompt_ids, params, n_samples=1, return_routed_experts=False, **kw):
        self.log.append(("submit", [p[0] for p in prompt_ids], params.seed))
        n = len(prompt_ids)
        if self.order == "fifo":
            order = list(range(n))
        elif self.order == "reverse":
            order = list(range(n))[::-1]
        else:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(int(self.order))).tolist()

        def items():
            for i in order:  # lazy: a group is "generated" only when the consumer asks for it
                pid = prompt_ids[i][0]
                self.log.append(("yield", pid, params.seed))
                yield i, [Sample(prompt_ids=list(prompt_ids[i]), response_ids=[pid, params.seed % 97, j],
                                 logprobs=np.zeros(3, np.float32), finish_reason="stop") for j in range(n_samples)]
            yield None, (0.0, 1.0)

        return StreamingGeneration(n, items())


class SeqStream:
    def __init__(self):
        self.pos = 0

    def take(self, n):
        self.pos += n
        return torch.arange(self.pos - n, self.pos)


def make_trainer(n_prompts=40, target=4, factor=3.0, order="fifo", informative=lambda pid: pid % 3 != 0):
    """A RolloutPhases at world size 1 with the stand-in engine; prompt ``pid`` has ids [pid] and its group is
    informative (one of K correct) iff ``informative(pid)``."""

    class Tr(RolloutPhases):
        def distribute(self, samples):  # the rows themselves (no model here)
            return list(samples)

    tr = Tr()
    tr.cfg = SimpleNamespace(
        rollout=SimpleNamespace(temperature=1.0, top_p=1.0, max_new_tokens=4, k=K, prompts_per_step=target,
                                length_tail=RolloutLengthTailCfg()),
        train=SimpleNamespace(seed=3), algo=SimpleNamespace(refill_max_factor=factor, dynamic_sampling=True))
    tr.rank, tr.step_idx, tr.r3_on, tr.daps = 0, 5, False, None
    tr.rank0 = SimpleNamespace(share=lambda phase, obj: obj)
    tr.source = SimpleNamespace(generate=lambda fn: fn())
    tr.placement = SimpleNamespace(place=lambda *a, **k: None)
    tr.prompts = [Prompt(ids=[p], text="", reference=str(p)) for p in range(n_prompts)]
    tr.stream = SeqStream()  # prompts 0, 1, 2, ... in order: round 0 is [0, 1, 2, 3]
    tr.engine = StandInEngine(order)
    tr.decode = lambda ids: f"{ids[0]} {ids[2]}"
    tr.score = lambda texts, refs: [1.0 if informative(int(t.split()[0])) and t.split()[1] == "0" else 0.0
                                    for t in texts]
    return tr


def test_replacement_is_submitted_before_the_rounds_last_group():
    tr = make_trainer(order="fifo")
    r = tr.rollout_eager({})
    log = tr.engine.log
    first_pids = log[0][1]
    last_first_yield = max(i for i, ev in enumerate(log) if ev[0] == "yield" and ev[2] == log[0][2])
    first_repl = next(i for i, ev in enumerate(log) if ev[0] == "submit" and i > 0)
    assert first_pids == [0, 1, 2, 3]  # prompt 0 (uninformative) arrives first, 3 (uninformative) last
    assert first_repl < last_first_yield, log
    # each replacement is its own one-group call with its slot's seed (round 1 + j), in submission order
    repl = [ev for ev in log[1:] if ev[0] == "submit"]
    from megatron_s3ac.trainer.step.rollout_phases import sampling_params
    assert [ev[2] for ev in repl] == [sampling_params(tr.cfg, 5, 1 + j).seed for j in range(len(repl))]
    assert all(len(ev[1]) == 1 for ev in repl)
    assert r.metrics["filter/kept_groups"] == 4 and len(r.kept) == 4 * K
    assert all(d["pid"] % 3 != 0 for d in r.kept)
    assert r.metrics["refill/drawn_groups"] == 4 + len(repl) and r.metrics["refill/surplus_groups"] == 0


def test_slow_first_group_replacements_run_beside_it():
    """The round's first slot is the slow one (it comes back last): replacements for the groups filtered before it
    are submitted before it returns."""
    tr = make_trainer(order="reverse")
    tr.rollout_eager({})
    log = tr.engine.log
    slow = log[0][1][0]  # slot 0's prompt, yielded last by the reversed stream
    i_slow = next(i for i, ev in enumerate(log) if ev == ("yield", slow, log[0][2]))
    early = [i for i, ev in enumerate(log) if ev[0] == "submit" and 0 < i < i_slow]
    assert early, log  # prompt 3 (uninformative) came back first


@pytest.mark.parametrize("order", ["reverse", "7", "13"])
def test_kept_batch_does_not_depend_on_arrival_order(order):
    ref = make_trainer(order="fifo").rollout_eager({})
    got = make_trainer(order=order).rollout_eager({})
    key = lambda r: [(d["pid"], tuple(d["response_ids"]), d["reward"]) for d in r.kept]  # noqa: E731
    assert key(got) == key(ref)
    assert [(d["pid"], d["reward"]) for d in got.samples] == [(d["pid"], d["reward"]) for d in ref.samples]
    assert {k: v for k, v in got.metrics.items()} == {k: v for k, v in ref.metrics.items()}


def test_drawn_group_bound_holds_and_reports_short():
    # only every fifth prompt is informative: the budget (3 x 4 = 12 groups) runs out first
    tr = make_trainer(informative=lambda pid: pid % 5 == 0)
    r = tr.rollout_eager({})
    assert r.metrics["refill/drawn_groups"] <= 12
    submits = [ev for ev in tr.engine.log if ev[0] == "submit"]
    assert sum(len(ev[1]) for ev in submits) == r.metrics["refill/drawn_groups"]
    n_good = sum(1 for d in r.samples if d["pid"] % 5 == 0) // K
    assert r.metrics["filter/kept_groups"] == min(4, n_good)
    if n_good < 4:
        assert r.metrics["refill/drawn_groups"] == 12 and r.metrics["refill/reached_target"] == 0.0
    assert r.metrics["filter/discarded_groups"] == r.metrics["refill/drawn_groups"] - n_good


def test_nothing_informative_spends_the_budget_and_keeps_nothing():
    tr = make_trainer(informative=lambda pid: False)
    r = tr.rollout_eager({})
    assert r.batch is None and r.metrics["filter/empty_batch"] == 1
    assert r.metrics["refill/drawn_groups"] == 12 and r.metrics["refill/rounds"] == 9


def test_all_informative_draws_no_replacement():
    tr = make_trainer(informative=lambda pid: True)
    r = tr.rollout_eager({})
    assert [ev[0] for ev in tr.engine.log].count("submit") == 1
    assert r.metrics["refill/rounds"] == 1 and r.metrics["refill/drawn_groups"] == 4


def test_config_rules():
    from megatron_s3ac.config import ConfigError, load_config

    base = "examples/cpu_demo.yaml"
    with pytest.raises(ConfigError, match="dynamic_sampling_refill"):
        load_config(base, ["algo.refill_eager=true", "rollout.placement=separate"])
    with pytest.raises(ConfigError, match="rollout.placement=separate"):
        load_config(base, ["algo.refill_eager=true", "algo.dynamic_sampling_refill=true"])
    cfg = load_config(base, ["algo.refill_eager=true", "algo.dynamic_sampling_refill=true",
                             "rollout.placement=separate"])
    assert cfg.algo.refill_eager
    assert load_config(base, []).algo.refill_eager is False


def test_eager_replacements_round_trip_through_a_checkpoint_file(tmp_path):
    """The asynchronous queue keeps a batch's reserve and (rank 0) its replacements with their versions."""
    from megatron_s3ac.rollout.base import PendingGeneration
    from megatron_s3ac.trainer.run.checkpoint import safe_load
    from megatron_s3ac.trainer.step import async_loop as AL
    from megatron_s3ac.trainer.step.rollout_phases import EagerRefill

    smp = Sample([1, 2], [4, 5], np.array([-0.5, -1.25], dtype=np.float32), "stop")
    ar = AL.AsyncSource(object(), 1)
    e = AL.Submitted(3, torch.tensor([7, 9]), {}, 2, PendingGeneration(lambda: [[smp], [smp]]))
    e.reserve = torch.tensor([11, 12, 13])
    e.eager = EagerRefill({0: [smp], 1: [smp], 2: [smp]}, {0: [1.0], 1: [0.0], 2: None}, {0: None, 1: None, 2: 3},
                          [])
    ar.queue.append(e)
    torch.save({"async_rollout": AL.state_dict(ar)}, tmp_path / "trainer_state.pt")
    st = safe_load(str(tmp_path / "trainer_state.pt"))["async_rollout"]
    back, other = AL.AsyncSource(object(), 1), AL.AsyncSource(object(), 1)
    AL.load_state_dict(back, st, rank=0)
    AL.load_state_dict(other, st, rank=1)
    (b,) = back.queue
    assert b.reserve.tolist() == [11, 12, 13] and other.queue[0].reserve.tolist() == [11, 12, 13]
    assert b.eager.rewards == {0: [1.0], 1: [0.0], 2: None} and b.eager.versions == {0: None, 1: None, 2: 3}
    assert b.eager.groups[2][0].response_ids == [4, 5] and other.queue[0].eager is None


def _eager_run(n, extra, out_dir):
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.step.trainer import Trainer
    from tests.trainer.test_trainer import SMALL

    sep = ["rollout.placement=separate", "actor_layout.ep=2", "train.eval_every=0"]
    tr = Trainer(load_config(None, SMALL + sep + [f"train.max_staleness={n}", "train.steps=3",
                                                  f"train.out_dir={out_dir}", "rollout.reward=test_char_parity",
                                                  "algo.dynamic_sampling_refill=true", "algo.refill_eager=true"]
                             + extra))
    try:
        calls = []
        if tr.rank == 0:  # every generation the engine is asked for: (first prompt, how many prompts, seed)
            real = tr.engine.generate_stream_async

            def spy(prompt_ids, params, *a, **kw):
                calls.append((len(prompt_ids), params.seed))
                return real(prompt_ids, params, *a, **kw)

            tr.engine.generate_stream_async = spy
        ms = [tr.step() for _ in range(3)]
        return {"metrics": ms, "calls": calls, "eager_log": list(getattr(tr.source, "eager_log", []))}
    finally:
        tr.close()


@pytest.mark.slow  # world size 2 with the CPU engine as a Ray actor: minutes at this machine's load
@pytest.mark.parametrize("n", [0, 1])
def test_eager_refill_end_to_end_world2(tmp_path, n):
    """The synchronous (N = 0, the engine in its own process) and the one-step asynchronous loop with eager
    refill: replacements are one-group calls, the drawn bound and the staleness bound hold, and a second run with
    the same seed gives the same metrics (timings aside)."""
    from megatron_s3ac.models.gloo_ranks import run_distributed

    r0, _ = run_distributed(_eager_run, 2, n, [], str(tmp_path / "a"))
    b0, _ = run_distributed(_eager_run, 2, n, [], str(tmp_path / "b"))
    strip = lambda ms: [{k: v for k, v in m.items() if not k.startswith("time/")} for m in ms]  # noqa: E731
    import json

    assert json.dumps(strip(r0["metrics"]), sort_keys=True) == json.dumps(strip(b0["metrics"]), sort_keys=True)
    for m in r0["metrics"]:
        assert m["refill/drawn_groups"] <= 3 * 8  # SMALL: 8 prompts per step, refill_max_factor 3
        assert m["refill/rounds"] == 1 + m["refill/drawn_groups"] - 8
        if n:
            assert m.get("async/staleness_max", 0) <= n
    assert any(size == 1 for size, _ in r0["calls"])  # some replacement was submitted
    if n:  # the real engine's stream: some replacement went out before its round's last group came back
        early = []
        for _, ev in r0["eager_log"]:
            last = max(t for kind, slot, t in ev if kind == "arrived" and slot < 8)
            early += [t for kind, slot, t in ev if kind == "submitted" and t < last]
        assert early, r0["eager_log"]
