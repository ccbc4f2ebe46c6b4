"""model.critic_privileged (issue 37): the critic reads prompt + a block built from the row's reference + response.

References: a hand-built sequence (prompt ids + the template's ids + response ids) for the critic's input, padded
and packed; a per-token loop of the bare critic on prompt + block + o_<t for the values (the value alignment test
extended); the critic at PP=2 and CP=2 against its own single-layout values; the actor's batch and the engine's
requests byte-identical with the key on and off.
"""
import pytest
import torch

from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.trainer.step.batch import collate, micro_batches, per_token
from megatron_s3ac.config import load_config
from megatron_s3ac.data.prompts import CharVocab
from megatron_s3ac.trainer.step.privileged import PrivilegedBlocks, block_text, critic_view
from tests.trainer.test_layouts_packing import _whole
from tests.trainer.test_trainer import SMALL, capture_batches

ROWS = [{"prompt_ids": [1, 5, 6, 7], "response_ids": [8, 9], "logprobs": [-1.0, -2.0], "reward": 1.0, "pid": 0},
        {"prompt_ids": [1, 4], "response_ids": [3], "logprobs": [-0.5], "reward": -1.0, "pid": 1},
        {"prompt_ids": [1, 2, 3], "response_ids": [5, 6, 7], "logprobs": [-1.0] * 3, "reward": 1.0, "pid": 2}]
BLOCKS = [[10, 11, 14], [14], [12, 13, 12, 14]]


def test_block_templates_and_missing():
    v = CharVocab()
    pb = PrivilegedBlocks.of("answer", v)
    assert pb.ids("42") == (v.encode("42="), False)
    assert pb.ids(None) == (v.encode("="), True)  # the empty form, counted
    assert PrivilegedBlocks.of("none", v) is None
    assert block_text("answer", "7", None, chars=False) == "\n\n[Reference answer]\n7\n\n"
    assert block_text("answer_and_solution", "7", "3+4", chars=False) == \
        "\n\n[Reference solution]\n3+4\n[Reference answer]\n7\n\n"
    with pytest.raises(ValueError, match="cannot encode the privileged block 'x='"):
        pb.ids("x")  # a reference outside the task's vocabulary is an error, not a silent id


def test_critic_view_is_prompt_block_response_padded_and_packed():
    b = collate(ROWS, pad_to=8)
    b.returns = torch.randn(b.mask.shape)
    v = critic_view(b, BLOCKS, pad_to=8)
    hand = [r["prompt_ids"] + blk + r["response_ids"] for r, blk in zip(ROWS, BLOCKS)]
    for i, seq in enumerate(hand):
        assert v.tokens[i, :len(seq)].tolist() == seq and not v.tokens[i, len(seq):].any()
    assert v.prompt_len.tolist() == [len(r["prompt_ids"]) + len(blk) for r, blk in zip(ROWS, BLOCKS)]
    for f in ("mask", "rollout_logp", "returns", "scores", "resp_len", "pid"):
        assert torch.equal(getattr(v, f), getattr(b, f)), f
    rows, real = torch.arange(3), torch.ones(3, dtype=torch.bool)
    (packed,) = micro_batches(v, rows, real, token_budget=64, pad_to=8)
    (padded,) = micro_batches(v, rows, real, pad_to=8)
    flat = [t for i in packed.row_ids.tolist() for t in hand[i]]
    assert packed.input_ids[0, :len(flat)].tolist() == flat
    for i, seq in enumerate(hand):
        assert padded.input_ids[i, :len(seq)].tolist() == seq
    # the output read for response token t is the one predicting it: position P + b - 1 + t
    for mb in (packed, padded):
        got = per_token(mb.input_ids.roll(-1, dims=1).float(), mb)
        for j, i in enumerate(mb.row_ids.tolist()):
            r = ROWS[i]["response_ids"]
            assert got[j, :len(r)].tolist() == [float(t) for t in r]


BASE = SMALL + ["algo.name=s3ac", "actor_layout.ep=1", "daps.enabled=false", "algo.dynamic_sampling=false",
                "train.eval_every=0"]


def _alignment(out_dir, packed):
    from megatron_s3ac.trainer.step.trainer import Trainer

    extra = ["algo.max_tokens_per_micro_batch=40"] if packed else []
    tr = Trainer(load_config(None, BASE + extra + ["model.critic_privileged=answer", f"train.out_dir={out_dir}"]))
    g = torch.Generator().manual_seed(0)
    rows = [{"prompt_ids": p.ids, "response_ids": torch.randint(3, 15, (n,), generator=g).tolist(),
             "reward": 1.0, "logprobs": [0.0] * n, "pid": i}
            for i, (p, n) in enumerate(zip(tr.prompts[:4], (1, 3, 5, 2)))]
    with torch.no_grad():
        batched = tr.critic_values(collate(rows, tr.pad_to))
        v0 = tr.critic_v0(torch.arange(4))
        loop = torch.zeros_like(batched)
        loop0 = torch.zeros(4)
        with tr.model_scope("critic"):
            for i, r in enumerate(rows):
                block = tr.vocab.encode(tr.prompts[i].reference + "=")  # the template by hand: "{answer}="
                for t in range(len(r["response_ids"])):
                    ids = torch.tensor([r["prompt_ids"] + block + r["response_ids"][:t]], device=tr.device)
                    pos = torch.arange(ids.shape[1], device=tr.device)[None]
                    loop[i, t] = tr.critic(ids, pos, None)[0, -1].float().cpu()
                loop0[i] = loop[i, 0]
    mask = torch.tensor([[float(t < len(r["response_ids"])) for t in range(batched.shape[1])] for r in rows])
    return batched * mask, loop * mask, v0.cpu(), loop0


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_privileged_value_of_token_t_sees_prompt_block_and_earlier_tokens(tmp_path, packed):
    batched, loop, v0, loop0 = run_distributed(_alignment, 1, str(tmp_path), packed)[0]
    assert loop.abs().sum() > 0
    torch.testing.assert_close(batched, loop, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(v0, loop0, rtol=1e-4, atol=1e-5)  # DAPS's V(s0) sees the block too


def _step_seen(out_dir, privileged):
    """One RL step; what the engine was asked, what the actor read, and the step's metrics."""
    from megatron_s3ac.trainer.step.trainer import Trainer

    tr = Trainer(load_config(None, BASE + [f"model.critic_privileged={privileged}", f"train.out_dir={out_dir}"]))
    requests, actor_inputs, critic_inputs = [], [], []
    gen = tr.engine.generate

    def spy_generate(prompts, *a, **k):
        requests.append([list(p) for p in prompts])
        return gen(prompts, *a, **k)

    tr.engine.generate = spy_generate
    fwd = tr._forward_only

    def spy_forward(which, batch, what):
        (actor_inputs if which == "actor" else critic_inputs).append(
            (tr.critic_input(batch) if which == "critic" else batch).tokens.clone())
        return fwd(which, batch, what)

    tr._forward_only = spy_forward
    seen = capture_batches(tr)
    m = tr.step()
    return {"requests": requests, "actor": actor_inputs, "critic": critic_inputs, "m": m,
            "prompt_len": seen[0].prompt_len, "resp_len": seen[0].resp_len, "pid": seen[0].pid, "refs": [p.reference for p in tr.prompts]}


def test_actor_and_engine_never_see_the_block(tmp_path):
    off = run_distributed(_step_seen, 1, str(tmp_path / "off"), "none")[0]
    on = run_distributed(_step_seen, 1, str(tmp_path / "on"), "answer")[0]
    assert on["requests"] and on["requests"] == off["requests"]  # every engine request, token for token
    assert len(on["actor"]) == len(off["actor"]) > 0
    for a, b in zip(on["actor"], off["actor"]):
        assert torch.equal(a, b)
    # the critic's rows: the actor's prompt, the reference + "=" (CharVocab ids), the actor's response
    from megatron_s3ac.data.prompts import CharVocab

    actor, crit = on["actor"][0], on["critic"][0]
    for i, (pid, P, R) in enumerate(zip(on["pid"].tolist(), on["prompt_len"].tolist(), on["resp_len"].tolist())):
        hand = actor[i, :P].tolist() + CharVocab().encode(on["refs"][pid] + "=") + actor[i, P:P + R].tolist()
        assert crit[i, :len(hand)].tolist() == hand and not crit[i, len(hand):].any()
    assert on["m"]["critic/privileged_missing"] == 0 and "critic/privileged_missing" not in off["m"]


# ---- the critic at PP=2 / CP=2 reads the same privileged sequences (2 gloo ranks) -------------------------
def _values(overrides, out_dir):
    from tests.trainer.test_layouts_packing import _one_step

    r = _one_step(overrides, out_dir)
    return {k: r[k] for k in ("gid", "critic_rows", "n", "values", "mask")}


@pytest.fixture(scope="module")
def priv_init(tmp_path_factory):
    from tests.trainer.test_layouts_packing import _save_init

    d = tmp_path_factory.mktemp("priv_init")
    run_distributed(_save_init, 1, str(d / "run"), str(d / "actor"), str(d / "critic"))
    return [f"model.actor_init={d / 'actor'}", f"model.critic_init={d / 'critic'}", "model.critic_privileged=answer"]


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [["actor_layout.pp=2"], ["actor_layout.pp=2", "algo.max_tokens_per_micro_batch=24"],
                                       ["actor_layout.ep=2", "actor_layout.cp=2", "critic_layout.cp=2"]],
                         ids=["pp2", "pp2-packed", "cp2"])
def test_privileged_values_are_layout_free(overrides, priv_init, tmp_path):
    ref = run_distributed(_values, 2, priv_init + ["actor_layout.ep=2"], str(tmp_path / "ref"))
    got = run_distributed(_values, 2, priv_init + overrides, str(tmp_path / "got"))
    g, r = _whole(got, "values", "critic_rows"), _whole(ref, "values", "critic_rows")
    assert r.abs().sum() > 0
    torch.testing.assert_close(g, r, atol=2e-5, rtol=0)


# ---- the sanity test's pieces: a prompt subset for RL, advantage whitening, the block bound ---------------------
def _subset_and_whitening(out_dir, subset_path):
    import json

    from megatron_s3ac.trainer.step.trainer import Trainer

    tr = Trainer(load_config(None, BASE + ["model.critic_privileged=answer", "algo.normalize_advantages=true",
                                           "daps.enabled=true", f"train.out_dir={out_dir}"]))
    keep = [tr.prompts[3], tr.prompts[7]]
    with open(subset_path, "w") as f:
        json.dump({"prompt_ids": [list(p.ids) for p in keep] + [[9, 9, 9]]}, f)  # an unknown prompt is ignored
    got = tr.use_prompt_subset(subset_path)
    seen = capture_batches(tr)
    m = tr.step()
    b = seen[0]
    adv = b.adv * b.mask
    n = b.mask.sum()
    mean, var = float(adv.sum() / n), float((adv ** 2).sum() / n) - float(adv.sum() / n) ** 2
    return {"got": got, "texts": sorted({tr.prompts[int(i)].text for i in b.pid}), "want": sorted(p.text for p in keep),
            "daps_n": len(tr.daps.S), "mean": mean, "var": var, "m": m,
            "priv": [tr._priv_ids[i] for i in range(len(tr.prompts))],
            "priv_want": [tr.vocab.encode(p.reference + "=") for p in keep]}


def test_prompt_subset_restricts_rl_and_advantages_are_whitened(tmp_path):
    r = run_distributed(_subset_and_whitening, 1, str(tmp_path / "run"), str(tmp_path / "subset.json"))[0]
    assert r["got"] == {"kept": 2, "of": 200} and r["daps_n"] == 2
    assert r["texts"] == r["want"]  # every rollout of the step is of a kept prompt
    assert r["priv"] == r["priv_want"]  # the critic's blocks follow the new prompt list
    assert abs(r["mean"]) < 1e-5 and abs(r["var"] - 1.0) < 1e-4  # over the step's valid tokens


def test_prompt_subset_and_block_bound_bad_input(tmp_path):
    from megatron_s3ac.trainer.step.build import read_prompt_subset

    bad = tmp_path / "bad.json"
    bad.write_text('{"prompt_ids": [["a"]]}')
    with pytest.raises(ValueError, match=r"bad\.json: prompt_ids must be a non-empty list of token id lists"):
        read_prompt_subset(str(bad))
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"bad\.json: not a JSON object with prompt_ids"):
        read_prompt_subset(str(bad))
    pb = PrivilegedBlocks.of("answer", CharVocab(), max_tokens=3)
    with pytest.raises(ValueError, match="is 4 tokens, above model.critic_privileged_max_tokens=3"):
        pb.ids("123")


def test_planner_counts_the_block_in_the_critic_sequences():
    from megatron_s3ac.models.registry import model_info
    from megatron_s3ac.models.parallel import ParallelLayout
    from megatron_s3ac.plan.memory import Cluster, Knobs, Workload, estimate

    import os

    info = model_info(os.path.join(os.path.dirname(__file__), "..", "..", "examples", "hf_configs",
                                   "qwen2_5_math_1_5b"))
    lay, cl = ParallelLayout(tp=1), Cluster(gpus=8)
    base = estimate(info, lay, cl, Workload(prompt_len=1024, response_len=4096), Knobs())
    more = estimate(info, lay, cl, Workload(prompt_len=1024, response_len=4096, critic_extra_tokens=1024), Knobs())
    # the critic's activations grow with its sequences (5120 -> 6144 tokens: x 1.2); the actor's do not move
    assert more.stages[0].act_actor == base.stages[0].act_actor
    assert more.stages[0].act_critic == pytest.approx(base.stages[0].act_critic * 6144 / 5120, rel=0.01)
    from megatron_s3ac.plan.memory import critic_block_tokens

    assert critic_block_tokens({"model": {"critic_privileged": "answer", "critic_privileged_max_tokens": 96}}) == 96
    assert critic_block_tokens(load_config(None, ["model.tiny=arithmetic_moe", "model.critic_privileged=answer"])) == 64
    assert critic_block_tokens(load_config(None, ["model.tiny=arithmetic_moe"])) == 0 and critic_block_tokens(None) == 0


# ---- answer_and_solution end to end: a prompt file with a solution column, an HF tokenizer ---------------------
# every character the prompts, references, solutions and the text template use
_TEXT_CHARS = "0123456789+=-*/ \n[]:.?abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_MATH_ROWS = [{"prompt": "What is 3+4?", "answer": "7", "solution": "3+4=7"},
              {"prompt": "What is 2*5?", "answer": "10", "solution": "2*5=10"},
              {"prompt": "What is 9-1?", "answer": "8"}]  # no solution: the block's empty form, counted


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    """A tiny qwen3 model whose tokenizer is a character vocabulary over ``_TEXT_CHARS`` (a real HF tokenizer, so
    the text template is used), and a math jsonl of three rows, one without a solution."""
    import json

    from megatron_s3ac.data.char_tokenizer import save_char_tokenizer
    from megatron_s3ac.data.prompts import BOS, EOS, PAD
    from megatron_s3ac.models.tiny_models import save_tiny_hf

    d = tmp_path_factory.mktemp("text_model")
    vocab = CharVocab(_TEXT_CHARS)
    save_tiny_hf("qwen3", str(d / "hf"), seed=0, vocab_size=vocab.size, eos_token_id=EOS, pad_token_id=PAD,
                 bos_token_id=BOS)
    save_char_tokenizer(vocab, str(d / "hf"))
    with open(d / "rows.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in _MATH_ROWS)
    return d


def _solution_step(out_dir, model_dir):
    from transformers import AutoTokenizer

    from megatron_s3ac.trainer.step.trainer import Trainer

    tr = Trainer(load_config(None, [
        "data.task=math", "model.tiny=null", f"model.hf_config={model_dir}/hf", f"data.path={model_dir}/rows.jsonl",
        "data.apply_chat_template=false", "rollout.reward=test_char_parity", "rollout.k=2",
        "rollout.prompts_per_step=3", "rollout.max_new_tokens=3", "algo.name=s3ac", "algo.actor_minibatches=1",
        "algo.critic_minibatches=1", "algo.dynamic_sampling=false", "daps.enabled=false", "train.eval_every=0",
        "train.progress=false", "train.tensorboard=false", "model.critic_privileged=answer_and_solution",
        f"train.out_dir={out_dir}"]))
    crit = []
    fwd = tr._forward_only

    def spy(which, batch, what):
        if which == "critic":
            crit.append((tr.critic_input(batch).tokens.clone(), batch.tokens.clone(), batch.prompt_len.clone(),
                         batch.resp_len.clone(), batch.pid.clone()))
        return fwd(which, batch, what)

    tr._forward_only = spy
    m = tr.step()
    tok = AutoTokenizer.from_pretrained(f"{model_dir}/hf")
    refs = [(p.reference, p.solution) for p in tr.prompts]
    return {"crit": crit[0], "m": m, "refs": refs,
            "blocks": [tok(block_text("answer_and_solution", a, s, chars=False), add_special_tokens=False)["input_ids"]
                       for a, s in refs]}


@pytest.mark.slow  # ~30 s: a tokenizer-built model and one step
def test_answer_and_solution_block_from_the_prompt_files_solution_column(text_model, tmp_path):
    """The critic reads prompt + "[Reference solution] ... [Reference answer] ..." (the HF tokenizer's ids of the
    text template filled from the row's ``solution`` and ``answer``) + response; the row without a solution gets
    the empty form and is counted in ``critic/privileged_missing`` (K = 2 samples of it)."""
    r = run_distributed(_solution_step, 1, str(tmp_path / "run"), str(text_model))[0]
    crit, tokens, P, R, pid = r["crit"]
    assert [s is None for _, s in r["refs"]].count(True) == 1
    for i in range(len(tokens)):
        p, n, j = int(P[i]), int(R[i]), int(pid[i])
        hand = tokens[i, :p].tolist() + r["blocks"][j] + tokens[i, p:p + n].tolist()
        assert crit[i, :len(hand)].tolist() == hand and not crit[i, len(hand):].any()
    assert "[Reference solution]" in block_text("answer_and_solution", "7", "3+4=7", chars=False)
    missing = sum(r["refs"][int(j)][1] is None for j in pid.tolist())
    assert missing == 2 and r["m"]["critic/privileged_missing"] == missing


# ---- the asynchronous loop: the prefetched batch's critic reads the block too -----------------------------------
def _async_seen(out_dir):
    from megatron_s3ac.trainer.step.trainer import Trainer

    tr = Trainer(load_config(None, BASE + ["model.critic_privileged=answer", "train.max_staleness=1",
                                           "rollout.placement=separate", "train.steps=2", f"train.out_dir={out_dir}"]))
    try:
        crit, fwd = [], tr._forward_only

        def spy(which, batch, what):
            if which == "critic" and what == "values" and len(batch) > 1:  # the step's values (not DAPS's V(s0))
                crit.append((tr.critic_input(batch).tokens.clone(), batch.tokens.clone(), batch.prompt_len.clone(),
                             batch.resp_len.clone(), batch.pid.clone()))
            return fwd(which, batch, what)

        tr._forward_only = spy
        ms = [tr.step() for _ in range(2)]
        return {"crit": crit, "st": [m.get("async/staleness_max") for m in ms],
                "missing": [m.get("critic/privileged_missing") for m in ms], "refs": [p.reference for p in tr.prompts]}
    finally:
        tr.close()


@pytest.mark.slow  # a separate engine process and two steps
def test_async_source_batches_reach_the_critic_with_the_block(tmp_path):
    """train.max_staleness=1: step 1 trains a batch generated a version earlier; its critic forwards (the values for
    GAE and the update) read prompt + "{answer}=" + response as in the synchronous loop."""
    r = run_distributed(_async_seen, 1, str(tmp_path / "run"))[0]
    assert r["st"][1] == 1.0 and r["missing"] == [0, 0]
    assert len(r["crit"]) >= 2
    for crit, tokens, P, R, pid in r["crit"]:
        for i in range(len(tokens)):
            p, n = int(P[i]), int(R[i])
            hand = tokens[i, :p].tolist() + CharVocab().encode(r["refs"][int(pid[i])] + "=") + tokens[i, p:p + n].tolist()
            assert crit[i, :len(hand)].tolist() == hand and not crit[i, len(hand):].any()


# ---- value pretraining of the privileged critic trains attention by default (issue 37's recipe) ---------------
def test_value_pretrain_freezes_by_default_only_the_plain_critic():
    from megatron_s3ac.config.algo import ValuePretrainCfg

    assert ValuePretrainCfg().freezes(privileged=False) and not ValuePretrainCfg().freezes(privileged=True)
    for v in (True, False):  # an explicit value wins either way
        assert ValuePretrainCfg(freeze_attention_and_router=v).freezes(False) is v
        assert ValuePretrainCfg(freeze_attention_and_router=v).freezes(True) is v


def _vpt_privileged(out_dir, overrides):
    from megatron_s3ac.trainer.step.trainer import Trainer
    from megatron_s3ac.trainer.stages.value_pretrain import value_pretrain

    tr = Trainer(load_config(None, SMALL + [f"train.out_dir={out_dir}", "value_pretrain.batch_size=8",
                                            "model.critic_privileged=answer"] + overrides))
    g = torch.Generator().manual_seed(0)
    rows = [{"prompt_ids": p.ids, "response_ids": torch.randint(3, 15, (3,), generator=g).tolist(),
             "reward": float(i % 2 * 2 - 1), "reference": p.reference} for i, p in enumerate(tr.prompts[:16])]
    before = {n: p.detach().clone() for n, p in tr.critic.named_parameters()}
    summary = value_pretrain(tr, rows)
    attn = [n for n in before if ".self_attention." in "." + n]
    return summary, attn, [n for n, p in tr.critic.named_parameters() if n in attn and not torch.equal(before[n], p)]


@pytest.mark.parametrize("key,frozen", [([], False), (["value_pretrain.freeze_attention_and_router=true"], True)],
                         ids=["default-trains-attention", "explicit-frozen"])
def test_privileged_value_pretraining_trains_attention_unless_told(key, frozen, tmp_path):
    summary, attn, changed = run_distributed(_vpt_privileged, 1, str(tmp_path), key)[0]
    assert attn and summary["vpt/privileged_missing"] == 0
    if frozen:
        assert summary["vpt/frozen_params"] > 0 and not changed
    else:
        assert summary["vpt/frozen_params"] == 0 and set(changed) == set(attn)
