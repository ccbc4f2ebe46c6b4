"""Context parallelism: logits and gradients at CP=2 and CP=2 x TP=2 equal the single-rank run (fp32).

The sequences are 13 tokens long (not a multiple of 2 x CP): the CP runs pad them to the layout's
``seq_multiple`` and mask the padding out of the loss; the reference runs the unpadded sequence.
As in test_parallel_equivalence, the reference saves its weights with dist_checkpointing, each CP
run loads them at its layout, runs forward + backward through megatron's schedule (DDP over DP x CP,
finalize_model_grads) and saves its gradients as a sharded checkpoint that the reference layout reads
back. Errors: logits and every gradient tensor, max |diff| / max |ref| <= 1e-5 (no floor), except
Qwen3.5's GDN decay parameters (A_log, dt_bias), held to the same 1e-5 per head relative to the sum of
the absolute per-token contributions their gradient adds up, S_h = sum_{b,t} |c_bth| (dL/dg g and dL/dz
for g = -exp(A_log) softplus(z), z = alpha + dt_bias; captured in the reference run, ``_DecayScales``).
Why that measure: those gradients are sums over tokens whose terms largely cancel (|grad| down to
~1e-6 against ~1e-1 elsewhere), and fp32 summation error is bounded relative to
sum |c|, not |sum c| (|fl(sum c) - sum c| <= n eps sum |c|). Relative to the tensor itself (max- or
norm-relative alike) they read up to 8.8e-5 at CP=2 and 2.0e-5 at CP=2 x TP=2 (and above 1e-5 at TP=2
without CP): fp32 rounding of the upstream per-token gradients (the reduction order changes with the
layout) amplified by the cancellation, not CP. Relative to S_h they are <= 9.7e-7 at CP=2 and <= 1.9e-6
at CP=2 x TP=2, every other tensor <= 1.6e-6 / 2.7e-6 (2026-12-02, CP_TEST_DEBUG=1 prints all three
measures per tensor). The test also asserts S_h >= |ref_h| (the captured terms are the gradient's).
"""
import os

import pytest
import torch

from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.models.tiny_models import tiny_config

B, S = 2, 13
PACK = (5, 8)  # the packed case: two samples in one row, block-diagonal causal mask
REL = 1e-5


def test_split_positions_and_mask():
    """The load-balanced split and the local causal mask, against hand-derived values."""
    from megatron_s3ac.models.context_parallel import _local_mask, gathered_positions, local_positions, split_for_cp

    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert gathered_positions(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    t = torch.arange(24).view(1, 24)
    parts = [split_for_cp(t, 1, 3, r) for r in range(3)]
    assert parts[0].tolist() == [[0, 1, 2, 3, 20, 21, 22, 23]]
    assert parts[2].tolist() == [[8, 9, 10, 11, 12, 13, 14, 15]]
    with pytest.raises(ValueError, match="multiple of 2 x cp"):
        local_positions(6, 2, 0)
    # rank 1 of cp=2, s=8: queries at 2..5, keys in gathered order 0,1,6,7,2,3,4,5
    m = _local_mask(None, 4, 2, 1, None)[0, 0]
    assert m.tolist() == [[True, True, False, False, True, False, False, False],
                          [True, True, False, False, True, True, False, False],
                          [True, True, False, False, True, True, True, False],
                          [True, True, False, False, True, True, True, True]]
    full = torch.ones(8, 8, dtype=torch.bool).triu(1)  # megatron convention: True = masked
    assert torch.equal(_local_mask(full[None, None], 4, 2, 1, None)[0, 0], m)


def test_cp_comm_is_validated():
    """``cp_comm`` is allgather | ring; anything else is refused by the layout check, naming the key."""
    from megatron_s3ac.models.parallel import LayoutError, ParallelLayout
    from megatron_s3ac.models.registry import model_info

    info = model_info(tiny_config("qwen3").to_dict())
    for comm in ("allgather", "ring"):
        ParallelLayout(cp=2, cp_comm=comm).validate(info, 2)
    with pytest.raises(LayoutError, match="cp_comm='all_gather' must be one of allgather, ring"):
        ParallelLayout(cp=2, cp_comm="all_gather").validate(info, 2)


def _attention_cp_rank(comm, cp, masked):
    """One CP rank of the attention-level check: this rank's q / k / v (the load-balanced split of the
    same random [s, b, heads, hn] tensors on every rank) through ``comm``'s CP attention, a random
    cotangent backpropagated; returns (out, dq, dk, dv) of this rank's positions."""
    import torch.distributed as dist

    from megatron_s3ac.models import context_parallel as cpm

    s, b, nq, ng, hn = 12, 2, 4, 2, 8
    g = torch.Generator().manual_seed(5)
    q, k, v, cot = (torch.randn(s, b, n, hn, generator=g) for n in (nq, ng, ng, nq))
    mask = _packed_mask((5, 4), s).expand(b, 1, s, s) if masked else None
    r = dist.get_rank()
    ql, kl, vl = (cpm.split_for_cp(t, 0, cp, r).requires_grad_() for t in (q, k, v))
    fn = cpm.cp_ring_attention if comm == "ring" else cpm.cp_core_attention
    out = fn(ql, kl, vl, mask, None, 0.0, dist.group.WORLD)
    (out * cpm.split_for_cp(cot, 0, cp, r).reshape(out.shape)).sum().backward()
    return out.detach(), ql.grad, kl.grad, vl.grad


@pytest.mark.parametrize("comm,masked", [("allgather", True), ("ring", False), ("ring", True)],
                         ids=["allgather-packed", "ring-causal", "ring-packed"])
def test_cp_attention_matches_full_sdpa(comm, masked):
    """Both CP attention exchanges (K / V all-gather; ring with online-softmax merge) at CP=3 (a
    3-hop ring: blocks that pass through a rank they do not belong to) equal full-sequence SDPA
    (GQA 4 q / 2 kv heads) in the forward and in dQ / dK / dV: causal and a packed block-diagonal
    mask (a padding tail that is its own block). Reference: single-process torch SDPA + autograd."""
    import torch.nn.functional as F

    from megatron_s3ac.models.context_parallel import split_for_cp

    cp = 3
    res = run_distributed(_attention_cp_rank, cp, comm, cp, masked)
    s, b, nq, ng, hn = 12, 2, 4, 2, 8
    g = torch.Generator().manual_seed(5)
    q, k, v, cot = (torch.randn(s, b, n, hn, generator=g) for n in (nq, ng, ng, nq))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = _packed_mask((5, 4), s).expand(b, 1, s, s) if masked else None
    qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    kk, vv = kk.repeat_interleave(nq // ng, 1), vv.repeat_interleave(nq // ng, 1)
    ref = F.scaled_dot_product_attention(qq, kk, vv, is_causal=not masked,
                                         attn_mask=None if mask is None else ~mask)
    ref = ref.permute(2, 0, 1, 3).reshape(s, b, nq * hn)
    (ref * cot.reshape(ref.shape)).sum().backward()
    for r, (out, dq, dk, dv) in enumerate(res):
        for got, want in ((out, ref.detach()), (dq, q.grad), (dk, k.grad), (dv, v.grad)):
            want = split_for_cp(want, 0, cp, r).reshape(got.shape)
            assert rel_err(got, want) <= REL, (comm, masked, r, rel_err(got, want))


def _batch(vocab, packed):
    g = torch.Generator().manual_seed(7)
    if packed:
        ids = torch.randint(0, vocab, (1, sum(PACK) + 1), generator=g)
    else:
        ids = torch.randint(0, vocab, (B, S + 1), generator=g)
    return ids


def _packed_mask(lengths, s):
    """megatron-convention block-diagonal causal mask [1, 1, s, s]; a padding tail is its own block."""
    lens = list(lengths) + ([s - sum(lengths)] if s > sum(lengths) else [])
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    return ~((seg[:, None] == seg[None, :]) & causal)[None, None]


def _build(cfg_dict, layout):
    import torch.distributed as dist

    from megatron_s3ac.models.actor_critic import build_actor, build_transformer_config
    from megatron_s3ac.models.optim import wrap_ddp
    from megatron_s3ac.models.parallel import initialize_model_parallel
    from megatron_s3ac.models.registry import model_info

    info = model_info(cfg_dict)
    layout.validate(info, dist.get_world_size())
    initialize_model_parallel(layout, seed=3)
    torch.manual_seed(11)
    config = build_transformer_config(info, layout)
    model = build_actor(info, config)
    return info, config, model, wrap_ddp(model, config, distributed_optimizer=False)


def _loss_fn(info, batch, out):
    """Sum of -log p over this CP rank's real tokens, and their count; the whole sequence's logits
    (gathered over TP and CP) for the comparison."""
    from megatron_s3ac.models.context_parallel import gather_from_cp, split_for_cp
    from megatron_s3ac.models.logprobs import gather_vocab, vocab_parallel_log_probs

    labels, valid = split_for_cp(batch["labels"], 1), split_for_cp(batch["valid"], 1)
    lp = vocab_parallel_log_probs(out, labels, info.vocab_size)
    full = gather_from_cp(gather_vocab(out.detach(), info.vocab_size))
    return -(lp * valid).sum(), valid.sum().to(torch.int), {"out": full[:, :batch["n_real"]]}


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _DecayScales:
    """Reference run only: the per-head sums of |per-token contribution| of the GDN decay gradients,
    S[A_log]_h = sum_{b,t} |dL/dg_bth g_bth| and S[dt_bias]_h = sum_{b,t} |dL/dz_bth| (z = alpha + dt_bias,
    g = -exp(A_log) softplus(z)), the scale of fp32 summation error (|fl(sum c) - sum c| <= n eps sum |c|).
    Captured by wrapping ``F.softplus`` (called once per GDN layer, in layer order, on z [b, s, nv]):
    dL/dz is z's gradient, and dL/dg g = dL/dsp sp with sp = softplus(z)."""

    def __init__(self, info):
        self.nv, self.calls = info.hf.get("linear_num_value_heads"), []

    def __enter__(self):
        import torch.nn.functional as F

        self.F, self.orig = F, F.softplus

        def softplus(z, *a, **kw):
            sp = self.orig(z, *a, **kw)
            if z.requires_grad and z.dim() == 3 and z.shape[-1] == self.nv:
                slot = {}
                self.calls.append(slot)
                z.register_hook(lambda g: slot.__setitem__("dt_bias", g.abs().sum((0, 1))))
                sp.register_hook(lambda g: slot.__setitem__("A_log", (g * sp.detach()).abs().sum((0, 1))))
            return sp

        F.softplus = softplus
        return self

    def __exit__(self, *exc):
        self.F.softplus = self.orig
        return False

    def result(self, model):
        """{parameter name: S [nv]} for every GDN layer's A_log / dt_bias (layer order = call order)."""
        names = sorted((k for k, _ in model.named_parameters() if k.endswith(".A_log")),
                       key=lambda k: int(k.split("layers.")[1].split(".")[0]))
        assert len(names) == len(self.calls), (names, len(self.calls))
        out = {}
        for name, slot in zip(names, self.calls):
            prefix = name[: -len("A_log")]
            out[prefix + "A_log"], out[prefix + "dt_bias"] = slot["A_log"], slot["dt_bias"]
        return out


def run_layout(cfg_dict, layout, ckpt_dir, grad_dir, save_ref, packed):
    from functools import partial

    from megatron.core import dist_checkpointing

    from megatron_s3ac.models.context_parallel import pad_len
    from megatron_s3ac.models.pipeline import forward_backward

    info, config, model, ddp = _build(cfg_dict, layout)
    if save_ref:
        os.makedirs(ckpt_dir, exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    else:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir))
    ids = _batch(info.vocab_size, packed)
    n = ids.shape[1] - 1
    s = n if layout.cp == 1 and layout.tp == 1 else pad_len(n, layout.seq_multiple)
    assert s == n or n % (2 * layout.cp), "the test must pad"
    inp = torch.zeros(ids.shape[0], s, dtype=torch.long)
    labels = torch.zeros_like(inp)
    valid = torch.zeros(ids.shape[0], s)
    inp[:, :n], labels[:, :n], valid[:, :n] = ids[:, :-1], ids[:, 1:], 1.0
    if packed:  # the first token of the second sample is not predicted from the first sample
        valid[0, PACK[0] - 1] = 0.0
    mb = {"input_ids": inp, "labels": labels, "valid": valid, "n_real": n}
    if packed:
        mb["attention_mask"] = _packed_mask(PACK, s)
    ddp.zero_grad_buffer()
    scales = _DecayScales(info) if save_ref else None
    with scales or _nullcontext():
        out = forward_backward([ddp], [mb], partial(_loss_fn, info))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.main_grad)
    os.makedirs(grad_dir, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), grad_dir)
    logits = out[0]["out"] if out else None
    return (logits, scales.result(model)) if save_ref else logits


def read_ckpt(cfg_dict, layout, ckpt_dir):
    from megatron.core import dist_checkpointing

    _, _, model, _ = _build(cfg_dict, layout)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir))
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "_extra_state" not in k}


def rel_err(a, ref):
    return ((a - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    from megatron_s3ac.models.parallel import ParallelLayout

    cache = {}

    def get(model_type, packed, **overrides):
        key = (model_type, packed, tuple(sorted(overrides.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp(f"{model_type}_{'packed' if packed else 'rows'}")
            cfg = _config(model_type, **overrides)
            out, scales = run_distributed(run_layout, 1, cfg, ParallelLayout(), str(d / "w"), str(d / "g"), True,
                                          packed)[0]
            grads = run_distributed(read_ckpt, 1, cfg, ParallelLayout(), str(d / "g"))[0]
            cache[key] = (cfg, d, out, grads, scales)
        return cache[key]

    return get


def _config(model_type, **overrides):
    if model_type == "qwen3_5_moe":
        from megatron_s3ac.models.tiny_qwen3_5 import tiny_qwen3_5_config

        return tiny_qwen3_5_config("text", **overrides).to_dict()
    return tiny_config(model_type, **overrides).to_dict()


def check(refs, tmp_path, model_type, layout_kw, world, packed=False, **overrides):
    from megatron_s3ac.models.parallel import ParallelLayout

    cfg, d, ref_out, ref_grads, scales = refs(model_type, packed, **overrides)
    layout = ParallelLayout(**layout_kw)
    outs = run_distributed(run_layout, world, cfg, layout, str(d / "w"), str(tmp_path / "g"), False, packed)
    outs = [o for o in outs if o is not None]
    assert len(outs) == world
    for o in outs:
        assert o.shape == ref_out.shape
        err = rel_err(o, ref_out)
        print(f"{model_type} {layout_kw} packed={packed}: logits rel err {err:.2e}")
        assert err <= REL
    grads = run_distributed(read_ckpt, 1, cfg, ParallelLayout(), str(tmp_path / "g"))[0]
    assert grads.keys() == ref_grads.keys()
    worst, nonzero, debug = 0.0, 0, os.environ.get("CP_TEST_DEBUG")
    for k, ref in ref_grads.items():
        if ref.abs().max() == 0:
            assert grads[k].abs().max() == 0, k
            continue
        nonzero += 1
        if k in scales:  # GDN decay: per head, |diff| over the sum of |per-token contributions|
            # the captured contributions sum to the reference gradient, so their |.| sum bounds it
            assert (ref.abs() <= scales[k] * (1 + 1e-4)).all(), (k, ref, scales[k])
            err = ((grads[k] - ref).abs() / scales[k]).max().item()
        else:
            err = rel_err(grads[k], ref)
        worst = max(worst, err)
        if debug:
            plain, norm = rel_err(grads[k], ref), ((grads[k] - ref).norm() / ref.norm()).item()
            extra = f" S {scales[k].min().item():.2e}" if k in scales else ""
            print(f"  {k}: {err:.2e} (max-rel {plain:.2e}, norm-rel {norm:.2e}) max|ref| {ref.abs().max().item():.2e}"
                  + extra)
            continue
        assert err <= REL, f"{k}: grad rel err {err:.2e}"
    print(f"{model_type} {layout_kw} packed={packed}: worst grad rel err {worst:.2e} over {nonzero} tensors")
    assert nonzero > len(ref_grads) // 2  # the comparison is not vacuous


@pytest.mark.parametrize("model_type", [pytest.param("qwen3", marks=pytest.mark.slow), "qwen3_moe"])
def test_cp2_matches_single_rank(refs, tmp_path, model_type):
    check(refs, tmp_path, model_type, dict(cp=2), 2)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_cp2_tp2_matches_single_rank(refs, tmp_path, model_type):
    check(refs, tmp_path, model_type, dict(cp=2, tp=2), 4)


def test_cp2_packed_mask_matches_single_rank(refs, tmp_path):
    """A packed row (block-diagonal mask over the whole sequence) split over CP ranks."""
    check(refs, tmp_path, "qwen3", dict(cp=2), 2, packed=True)


def test_qwen3_5_cp2_matches_single_rank(refs, tmp_path):
    """Qwen3.5-MoE: the GDN's head-parallel all-to-all and the gated attention's K/V all-gather."""
    check(refs, tmp_path, "qwen3_5_moe", dict(cp=2), 2)


@pytest.mark.slow
def test_qwen3_5_cp2_tp2_matches_single_rank(refs, tmp_path):
    # 4 key / 8 value GDN heads: tp*cp = 4 ranks each hold one key head
    check(refs, tmp_path, "qwen3_5_moe", dict(cp=2, tp=2), 4, linear_num_key_heads=4, linear_num_value_heads=8)


@pytest.mark.slow
@pytest.mark.parametrize("model_type,layout_kw,world,packed", [
    ("qwen3_moe", dict(cp=2), 2, False),
    ("qwen3", dict(cp=2), 2, True),
    ("qwen3_moe", dict(cp=2, tp=2), 4, False),
], ids=["qwen3_moe-cp2", "qwen3-cp2-packed", "qwen3_moe-cp2-tp2"])
def test_ring_matches_single_rank(refs, tmp_path, model_type, layout_kw, world, packed):
    """``cp_comm: ring`` (K / V passed round the CP ranks, online-softmax merge) inside the models:
    logits and gradients equal the single-rank run like the all-gather's."""
    check(refs, tmp_path, model_type, dict(layout_kw, cp_comm="ring"), world, packed=packed)


@pytest.mark.slow
def test_qwen3_5_ring_cp2_matches_single_rank(refs, tmp_path):
    """Qwen3.5-MoE's gated attention through the ring (the GDN's all-to-all is unchanged)."""
    check(refs, tmp_path, "qwen3_5_moe", dict(cp=2, cp_comm="ring"), 2)


@pytest.mark.slow
def test_te_cp_device_check_dry_run(tmp_path):
    """tools/device_checks/te_context_parallel.py --dry-run: the 2-GPU script's CP=1 -> CP=2 comparison on
    2 gloo CPU ranks in fp32 (torch all-gather and ring specs; TE reported skipped), exit 0 and PASS."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        os.path.join(root, "tools", "device_checks", "te_context_parallel.py"), "--dry-run",
                        str(tmp_path)], cwd=root, env=dict(os.environ, OMP_NUM_THREADS="1"),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "DEVICE CHECK PASS"
    res = json.loads(r.stdout[r.stdout.index("{"):r.stdout.rindex("}") + 1])
    assert res["te"].startswith("skipped")
    for spec in ("torch", "torch_ring"):
        assert res[spec]["logits_rel"] <= 1e-4 and res[spec]["worst_grad_rel"] <= 1e-4
