"""RemoteEngine: an engine hosted in a Ray actor behaves as the same engine in-process.

One local Ray instance per module (2 logical CPUs, no GPU). The main remote engine is the tiny MoE
CPUEngine; a mirror local engine receives every weight change the remote does, so each test can
compare the two whatever ran before. Failure-path tests use a stub engine defined here (pickled by
value, so its actor starts without importing torch) and cheap factories.
"""
import functools
import os
import pickle
import signal
import sys
import threading
import time

import numpy as np
import pytest
import ray
import torch
from transformers.core_model_loading import revert_weight_conversion

from megatron_s3ac.rollout.base import RolloutEngine, SamplingParams, iter_buckets
from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine
from megatron_s3ac.rollout.engines.cpu.remote import (
    RemoteEngine, RemoteEngineClosed, RemoteEngineDied, RemoteEngineTimeout, pack_bucket, unpack_bucket,
)
from rollout_fixtures import local_ray_by_value, tiny_moe_config

PROMPTS = [[4, 5, 13, 6, 7, 14], [8, 9, 14], [20, 21]]
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, top_k=6, max_new_tokens=12, seed=3)
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)


class StubEngine(RolloutEngine):
    """Records calls; generate sleeps `delay` seconds (a long call to kill or time out)."""

    def __init__(self, delay: float = 0.0):
        self.delay, self.calls = delay, []

    def generate(self, prompt_ids, params, n_samples=1, return_routed_experts=False):
        time.sleep(self.delay)
        return [[] for _ in prompt_ids]

    def update_weights(self, named_tensors):
        self.calls.append(("update_weights", [(n, tuple(t.shape), str(t.dtype)) for n, t in named_tensors]))

    def sleep(self, *args, **kwargs):
        self.calls.append(("sleep", args, kwargs))

    def wake(self, *args, **kwargs):
        self.calls.append(("wake", args, kwargs))

    def flush_cache(self):
        self.calls.append(("flush_cache",))


def stub(delay: float = 0.0, timeout_s: float = 60.0) -> RemoteEngine:
    return RemoteEngine(functools.partial(StubEngine, delay=delay), num_cpus=0, timeout_s=timeout_s)


@pytest.fixture(scope="module")
def ray_session():
    with local_ray_by_value(sys.modules[__name__]):  # StubEngine travels by value
        yield


@pytest.fixture(scope="module")
def engines(ray_session):
    """(remote, local): the same tiny MoE at the same seed, both on one torch thread (CPU reductions,
    hence the last bit of a log-prob, depend on the thread count; one thread also avoids
    oversubscribing a 2-core CI machine with two processes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    factory = functools.partial(CPUEngine.from_config, tiny_moe_config(), seed=0)
    try:
        with RemoteEngine(factory, timeout_s=120, torch_threads=1) as remote:
            yield remote, factory()
    finally:
        torch.set_num_threads(threads)


def hf_state(seed: int) -> dict:
    other = CPUEngine.from_config(tiny_moe_config(), seed=seed).model
    return revert_weight_conversion(other, dict(other.state_dict()))


def assert_same(a, b):
    assert [len(g) for g in a] == [len(g) for g in b]
    for ga, gb in zip(a, b):
        for x, y in zip(ga, gb):
            assert x.prompt_ids == y.prompt_ids and x.response_ids == y.response_ids
            assert x.finish_reason == y.finish_reason
            assert x.logprobs.dtype == y.logprobs.dtype and np.array_equal(x.logprobs, y.logprobs)
            if y.routed_experts is None:
                assert x.routed_experts is None
            else:
                assert x.routed_experts.dtype == y.routed_experts.dtype
                assert np.array_equal(x.routed_experts, y.routed_experts)


def test_iter_buckets_rule():
    arrays = [("a", np.zeros(3, np.float32)), ("b", np.zeros(2, np.float32)), ("big", np.zeros(10, np.float32)),
              ("c", torch.zeros(1)), ("d", torch.zeros(2, dtype=torch.bfloat16))]
    got = [[n for n, _ in b] for b in iter_buckets(iter(arrays), 20)]
    assert got == [["a", "b"], ["big"], ["c", "d"]]  # 12+8 | 40 alone | 4+4
    with pytest.raises(ValueError):
        next(iter_buckets(arrays, 0))


def test_pack_roundtrip_any_dtype_and_layout():
    src = [("f32", torch.randn(3, 4)), ("bf16", torch.randn(5, 2).bfloat16()), ("nc", torch.randn(4, 3).t()),
           ("bool", torch.tensor([True, False])), ("scalar", torch.tensor(2.5, dtype=torch.float64)),
           ("np", np.arange(6, dtype=np.int16).reshape(2, 3)), ("empty", torch.zeros(0, 4))]
    out, nbytes = unpack_bucket(pack_bucket(src))
    assert nbytes == sum(torch.as_tensor(t).numel() * torch.as_tensor(t).element_size() for _, t in src)
    for (n, t), (m, u) in zip(src, out):
        t = torch.as_tensor(t)
        assert n == m and u.dtype == t.dtype and u.shape == t.shape and torch.equal(u, t)


def _flat_params(named):
    """Parameters that view one flat buffer, as megatron's DDP keeps them: (module, the buffer)."""
    flat = torch.cat([t.detach().reshape(-1).float() for _, t in named])
    mod, at = torch.nn.Module(), 0
    for i, (_, t) in enumerate(named):
        mod.register_parameter(f"p{i}", torch.nn.Parameter(flat[at:at + t.numel()].view(t.shape), requires_grad=False))
        at += t.numel()
    return mod, flat


def test_pack_leaves_the_source_storage_offloadable():
    """Rehearsal finding 1 (separate placement + train.offload_idle): pack_bucket took its zero-copy view with
    Tensor.numpy(), which clears the resizable flag of the tensor's whole storage for good, so the trainer's DDP
    buffer, once synced, could not be offloaded (HostOffload's resize_(0): 'Trying to resize storage that is not
    resizable'). The records must still carry the exact bytes (pickled as Ray does) and the offload round trip
    must be bit-exact."""
    from megatron_s3ac.models.offload import HostOffload

    g = torch.Generator().manual_seed(0)
    named = [(n, torch.randn(*shape, generator=g)) for n, shape in (("a", (4, 6)), ("b", (3,)), ("c", (2, 5)))]
    mod, flat = _flat_params(named)
    want = [t.clone() for _, t in named]
    bucket = [(n, p.data) for (n, _), p in zip(named, mod.parameters())]
    out, _ = unpack_bucket(pickle.loads(pickle.dumps(pack_bucket(bucket), protocol=5)))  # as Ray sends them
    assert all(torch.equal(u, w) for (_, u), w in zip(out, want))
    assert flat.untyped_storage().resizable()
    h = HostOffload([mod])
    h.offload(("params",))
    assert flat.untyped_storage().nbytes() == 0
    h.onload(("params",))
    assert all(torch.equal(p, w) for p, w in zip(mod.parameters(), want))


def test_update_from_ddp_like_params_leaves_them_offloadable(engines):
    """The same through the actor: the weights sent from views of one flat buffer (as sync_weights feeds a trainer's
    params), offloaded and onloaded, sent again: the remote engine samples as the local one."""
    from megatron_s3ac.models.offload import HostOffload

    remote, local = engines
    named = list(hf_state(seed=4).items())
    assert all(t.dtype == torch.float32 for _, t in named)
    mod, flat = _flat_params(named)
    bucket = [(n, p.data) for (n, _), p in zip(named, mod.parameters())]
    remote.update_weights(bucket)
    h = HostOffload([mod])
    h.offload(("params",))  # before the fix: RuntimeError, the storage not resizable
    h.onload(("params",))
    remote.update_weights(bucket)
    local.update_weights(named)
    assert_same(remote.generate(PROMPTS, SAMPLED, n_samples=2, return_routed_experts=True),
                local.generate(PROMPTS, SAMPLED, n_samples=2, return_routed_experts=True))


def test_generate_equals_local(engines):
    remote, local = engines
    assert remote.ping()["engine"] == "CPUEngine" and remote.pid != os.getpid()
    for params in (SAMPLED, GREEDY):
        assert_same(remote.generate(PROMPTS, params, n_samples=3, return_routed_experts=True),
                    local.generate(PROMPTS, params, n_samples=3, return_routed_experts=True))
    assert_same(remote.generate(PROMPTS, SAMPLED, n_samples=2), local.generate(PROMPTS, SAMPLED, n_samples=2))
    assert remote.get("num_layers") == local.num_layers == 3


def test_update_weights_changes_logprobs_as_locally(engines):
    remote, local = engines
    before = remote.generate(PROMPTS, SAMPLED, n_samples=2, return_routed_experts=True)
    new = hf_state(seed=1)
    # a generator (streamed, never a list), mixed dtypes (bf16 is cast by the engine) and a non-contiguous tensor
    items = [(k, v.bfloat16() if "experts" in k else v) for k, v in new.items()]
    name = next(k for k, v in items if v.ndim == 2 and v.dtype == torch.float32)
    items = [(k, v.t().contiguous().t() if k == name else v) for k, v in items]
    local.update_weights(iter(items))
    remote.update_weights((k, v) for k, v in items)
    after = remote.generate(PROMPTS, SAMPLED, n_samples=2, return_routed_experts=True)
    assert_same(after, local.generate(PROMPTS, SAMPLED, n_samples=2, return_routed_experts=True))
    assert any(not np.array_equal(a.logprobs, b.logprobs) for ga, gb in zip(before, after) for a, b in zip(ga, gb))
    st = remote.last_update
    assert st.tensors == len(items) and st.bytes == sum(v.numel() * v.element_size() for _, v in items)
    # a partial update (a few tensors perturbed) moves both the same way
    part = [(k, v * 1.5) for k, v in list(new.items())[:4]]
    local.update_weights(part)
    remote.update_weights(part, bucket_bytes=1)  # one tensor per bucket
    assert remote.last_update.buckets == 4
    assert_same(remote.generate(PROMPTS, GREEDY, n_samples=1, return_routed_experts=True),
                local.generate(PROMPTS, GREEDY, n_samples=1, return_routed_experts=True))


def test_generate_async_runs_before_a_later_weight_update(engines):
    """generate_async returns at once; a weight update sent right after it loads after that generation (the actor
    runs its calls in order): the samples are the old weights', the next generate the new ones'."""
    remote, local = engines
    old = local.generate(PROMPTS, SAMPLED, n_samples=2, return_routed_experts=True)
    pending = remote.generate_async(PROMPTS, SAMPLED, n_samples=2, return_routed_experts=True)
    new = list(hf_state(seed=2).items())
    remote.update_weights(iter(new))  # sent while the generation may still run
    local.update_weights(iter(new))
    assert_same(pending.result(), old)
    assert pending.done() and pending.timing[0] <= pending.timing[1]
    assert_same(remote.generate(PROMPTS, SAMPLED, n_samples=2, return_routed_experts=True),
                local.generate(PROMPTS, SAMPLED, n_samples=2, return_routed_experts=True))


def test_bucket_cap_respected(engines):
    remote, local = engines
    sd = dict(local.model.named_parameters())
    experts = [(k, v) for k, v in hf_state(seed=0).items() if k.startswith("model.layers.0.mlp.experts.")]
    assert len(experts) == 24 and all(v.numel() * 4 == 2048 for _, v in experts)  # 8 experts x 3 projections
    cap = 8192
    remote.update_weights(experts, bucket_bytes=cap)
    local.update_weights(experts)
    st = remote.last_update
    assert st.bytes == 24 * 2048 and st.buckets == 6 and st.bucket_sizes == [8192] * 6  # as the actor received
    # a tensor above the cap travels alone; buckets around it stay under the cap
    embed = ("model.embed_tokens.weight", sd["model.embed_tokens.weight"].detach().clone())
    mixed = experts[:3] + [embed] + experts[3:5]
    remote.update_weights(iter(mixed), bucket_bytes=4096)
    local.update_weights(mixed)
    assert remote.last_update.bucket_sizes == [4096, 2048, embed[1].numel() * 4, 4096]
    assert_same(remote.generate(PROMPTS, GREEDY), local.generate(PROMPTS, GREEDY))


def test_weight_sync_feed_pattern(engines):
    """weight_sync.sync_weights calls engine.update_weights(bucket) per bucket, the tensors being views
    into one received uint8 payload (8-byte aligned), then engine.flush_cache()."""
    remote, local = engines
    items = list(hf_state(seed=2).items())
    for start in range(0, len(items), 7):
        chunk = items[start:start + 7]
        parts = []
        for _, t in chunk:
            b = t.contiguous().view(torch.uint8).reshape(-1)
            parts += [b, b.new_zeros(-b.numel() % 8)]
        payload, at, bucket = torch.cat(parts), 0, []
        for n, t in chunk:
            nb = t.numel() * t.element_size()
            bucket.append((n, payload[at:at + nb].view(t.dtype).view(t.shape)))
            at += nb + (-nb % 8)
        remote.update_weights(bucket)
        local.update_weights(bucket)
    remote.flush_cache()
    assert_same(remote.generate(PROMPTS, SAMPLED, n_samples=2, return_routed_experts=True),
                local.generate(PROMPTS, SAMPLED, n_samples=2, return_routed_experts=True))


def test_engine_errors_keep_their_type_and_the_actor(engines):
    remote, local = engines
    with pytest.raises(KeyError, match="unknown weight name"):
        remote.update_weights([("model.no_such.weight", torch.zeros(2))])
    with pytest.raises(ValueError, match="shape mismatch"):
        remote.update_weights([("model.norm.weight", torch.zeros(5))])
    with pytest.raises(ValueError, match="empty prompt"):
        remote.generate([[]], GREEDY)
    assert remote.alive
    assert_same(remote.generate(PROMPTS, GREEDY), local.generate(PROMPTS, GREEDY))


@pytest.mark.parametrize("bad", ["unknown name", "wrong shape", "integer dtype"])
def test_refused_multi_bucket_update_loads_nothing(engines, bad):
    """All or nothing across buckets (issue 26): an update streamed in several buckets whose last tensor is bad is
    refused, naming that tensor, before the first bucket is sent; the remote engine then generates exactly what the
    local mirror (which never saw the update) generates."""
    remote, local = engines
    items = list(hf_state(seed=3).items())
    norm = next(t for n, t in items if n == "model.norm.weight")
    culprit = {"unknown name": ("model.layers.0.mlp.no_such_proj.weight", torch.zeros(16, 32)),
               "wrong shape": ("model.norm.weight", torch.zeros(norm.numel() + 1)),
               "integer dtype": ("model.norm.weight", torch.zeros(norm.shape, dtype=torch.int32))}[bad]
    err = KeyError if bad == "unknown name" else ValueError
    with pytest.raises(err, match=culprit[0].replace(".", r"\.")):
        remote.update_weights(iter(items + [culprit]), bucket_bytes=4096)
    assert remote.alive
    assert_same(remote.generate(PROMPTS, GREEDY), local.generate(PROMPTS, GREEDY))
    assert_same(remote.generate(PROMPTS, SAMPLED, n_samples=2, return_routed_experts=True),
                local.generate(PROMPTS, SAMPLED, n_samples=2, return_routed_experts=True))


def test_sleep_wake_forwarded(engines):
    remote, local = engines
    state = {k: v.detach().clone() for k, v in local.model.state_dict().items()}
    remote.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        remote.generate(PROMPTS, GREEDY)
    remote.wake()
    with pytest.raises(RuntimeError, match="weights not loaded since wake"):
        remote.generate(PROMPTS, GREEDY)
    remote.update_weights(state.items())  # the mirror's weights (in-memory names) refill it
    remote.sleep(keep_cpu_backup=True)  # keyword arguments travel too
    remote.wake()
    assert_same(remote.generate(PROMPTS, SAMPLED, n_samples=2), local.generate(PROMPTS, SAMPLED, n_samples=2))


def test_stub_forwarding_and_close(ray_session):
    eng = stub()
    eng.sleep(["weights"])
    eng.wake(tags=["kv_cache"])
    eng.update_weights([("w", torch.zeros(2, 3, dtype=torch.bfloat16))])
    eng.flush_cache()
    assert eng.get("calls") == [("sleep", (["weights"],), {}), ("wake", (), {"tags": ["kv_cache"]}),
                                ("update_weights", [("w", (2, 3), "torch.bfloat16")]), ("flush_cache",)]
    handle = eng._actor
    with eng:
        pass  # __exit__ closes
    assert not eng.alive
    with pytest.raises(RemoteEngineClosed):
        eng.generate(PROMPTS, GREEDY)
    eng.close()  # idempotent
    with pytest.raises(ray.exceptions.RayActorError):  # the actor itself is gone
        ray.get(handle.ready.remote(), timeout=30)


def test_killed_actor_raises_instead_of_hanging(ray_session):
    eng = stub(delay=60)
    box = {}

    def call():
        try:
            eng.generate(PROMPTS, GREEDY)
        except BaseException as err:  # noqa: B902 - recorded for the main thread
            box["err"] = err

    worker = threading.Thread(target=call)
    t0 = time.monotonic()
    worker.start()
    time.sleep(1.0)  # generate is now running in the actor (sleeping 60 s)
    os.kill(eng.pid, signal.SIGKILL)
    worker.join(timeout=30)
    assert not worker.is_alive() and time.monotonic() - t0 < 30
    err = box["err"]
    assert isinstance(err, RemoteEngineDied)
    assert "died during generate()" in str(err) and f"pid {eng.pid}" in str(err) and "killed by a signal" in str(err)
    t0 = time.monotonic()
    with pytest.raises(RemoteEngineDied, match="died during generate"):  # later calls: at once, same cause
        eng.update_weights([("w", torch.zeros(1))])
    assert time.monotonic() - t0 < 1.0
    eng.close()


def test_call_timeout_kills_the_actor(ray_session):
    eng = stub(delay=60, timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(RemoteEngineTimeout, match=r"generate\(\) did not finish within 1 s"):
        eng.generate(PROMPTS, GREEDY)
    assert time.monotonic() - t0 < 15 and not eng.alive
    with pytest.raises(RemoteEngineTimeout):
        eng.flush_cache()
    handle = eng._actor
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(handle.ready.remote(), timeout=30)
    eng.close()


def test_factory_failures_are_named(ray_session):
    with pytest.raises(RemoteEngineDied, match="engine factory raised.*FileNotFoundError.*no_such_engine_dir"):
        RemoteEngine(functools.partial(open, "/no_such_engine_dir/config.json"), num_cpus=0, start_timeout_s=60)
    with pytest.raises(RemoteEngineDied, match="returned dict, not a rollout engine"):
        RemoteEngine(dict, num_cpus=0, start_timeout_s=60)
    t0 = time.monotonic()
    with pytest.raises(RemoteEngineTimeout, match=r"start \(engine factory\) did not finish within 2 s"):
        RemoteEngine(functools.partial(time.sleep, 60), num_cpus=0, start_timeout_s=2)
    assert time.monotonic() - t0 < 20


# ---- the real weight sync (trainer ranks -> RemoteEngine), unchanged -------------------------------------
def sync_rank_remote(hf_dir, ckpt_dir, tokens):
    """Rank body: TP=2 trainer perturbs and syncs into a RemoteEngine held by rank 0 (its own Ray)."""
    import torch.distributed as dist

    from megatron_s3ac.convert.verify import load_actor, make_layout
    from megatron_s3ac.rollout.sync.weight_sync import sync_weights
    from weight_sync_ranks import perturb_, trainer_log_probs

    def engine_lp(engine):
        logits = engine.call("model", input_ids=tokens, use_cache=False).logits.float()
        return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]

    info, model = load_actor(hf_dir, ckpt_dir, make_layout(2, 1, 1))
    perturb_(model)
    out = {"trainer": trainer_log_probs(model, info, tokens), "before": None, "after": None}
    engine = None
    try:
        if dist.get_rank() == 0:
            engine = RemoteEngine(functools.partial(CPUEngine.from_pretrained, hf_dir, tokenizer=None),
                                  bucket_bytes=1 << 20, ray_init_kwargs={"log_to_driver": False})
            out["before"] = engine_lp(engine)
        out["stats"] = sync_weights([model], info, engine, bucket_bytes=20_000)
        if engine is not None:
            out["after"] = engine_lp(engine)
    finally:
        if engine is not None:
            engine.close()
            ray.shutdown()
    return out


@pytest.mark.slow
def test_sync_weights_into_remote_engine(tmp_path):
    from megatron_s3ac.convert import hf_to_mcore
    from megatron_s3ac.models.gloo_ranks import run_distributed
    from megatron_s3ac.models.tiny_models import save_tiny_hf

    hf = save_tiny_hf("qwen3", str(tmp_path / "hf"), seed=10)
    mc = str(tmp_path / "mcore")
    hf_to_mcore(hf, mc, workers=1, progress=False)
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    results = run_distributed(sync_rank_remote, 2, hf, mc, tokens)
    trainer = next(r["trainer"] for r in results if r["trainer"] is not None)
    eng = results[0]
    assert (eng["after"] - trainer).abs().max().item() < 1e-5
    assert (eng["before"] - eng["after"]).abs().max().item() > 1e-2
    assert eng["stats"].buckets > 1
