"""Issue 29's controlled check, the alignment half: which prefix the critic's value of response token t sees.

The batched values (collate's idx = P - 1 + t, trainer.step.batch.per_token) must equal a per-token loop that runs the
bare critic model (no collate, no idx) on the prefix prompt + o_<t alone and reads its last position: V(s_t) is the value of the state *before*
o_t is chosen, the one value pretraining regresses on R and GAE uses. An off-by-one (reading P + t, which sees o_t,
or P - 2 + t) fails here. And the oracle target of tools/critic_reference_fit.py against hand-derived values.
"""
import os
import sys

import torch

from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["model.tiny=arithmetic_moe", "data.num_prompts=50", "data.eval_prompts=4", "train.progress=false",
         "train.tensorboard=false", "algo.name=s3ac"]


def _alignment(out_dir):
    from megatron_s3ac.trainer.step.batch import collate
    from megatron_s3ac.trainer.step.trainer import Trainer

    tr = Trainer(load_config(None, SMALL + ["actor_layout.ep=1", f"train.out_dir={out_dir}"]))
    g = torch.Generator().manual_seed(0)
    rows = [{"prompt_ids": p.ids, "response_ids": torch.randint(3, 15, (n,), generator=g).tolist(),
             "reward": 1.0, "logprobs": [0.0] * n, "pid": i}
            for i, (p, n) in enumerate(zip(tr.prompts[:4], (1, 3, 5, 2)))]
    with torch.no_grad():
        batched = tr.critic_values(collate(rows, tr.pad_to))
        loop = torch.zeros_like(batched)
        with tr.model_scope("critic"):
            for i, r in enumerate(rows):
                for t in range(len(r["response_ids"])):
                    # the bare critic (no collate, no idx) on prompt + o_<t; its last position is V(s_t)
                    ids = torch.tensor([r["prompt_ids"] + r["response_ids"][:t]], device=tr.device)
                    pos = torch.arange(ids.shape[1], device=tr.device)[None]
                    loop[i, t] = tr.critic(ids, pos, None)[0, -1].float().cpu()
    mask = torch.tensor([[float(t < len(r["response_ids"])) for t in range(batched.shape[1])] for r in rows])
    return batched * mask, loop * mask


def test_value_of_token_t_sees_prompt_and_earlier_tokens_only(tmp_path):
    batched, loop = run_distributed(_alignment, 1, str(tmp_path))[0]
    assert loop.abs().sum() > 0
    torch.testing.assert_close(batched, loop, rtol=1e-4, atol=1e-5)


def test_reference_fit_targets_hand_derived():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import critic_reference_fit as F

    class Tok:  # the char tokenizer's digit ids: '0' -> 4 ... '9' -> 13
        def convert_ids_to_tokens(self, i):
            return str(i - 4) if 4 <= i <= 13 else "="

        def convert_tokens_to_ids(self, s):
            return int(s) + 4

    d = lambda *xs: [x + 4 for x in xs]  # noqa: E731
    # prompt 3 5 9 -> chain 3 8 7; row 0 right (eos 2), row 1 wrong at token 1, row 2 wrong at token 2
    rows = [{"prompt_ids": [1] + d(3, 5, 9) + [14], "response_ids": d(3, 8, 7) + [2], "reward": 1.0},
            {"prompt_ids": [1] + d(3, 5, 9) + [14], "response_ids": d(3, 9, 7) + [2], "reward": -1.0},
            {"prompt_ids": [1] + d(3, 5, 9) + [14], "response_ids": d(3, 8, 1, 1), "reward": -1.0}]
    tokens, pos, mask, ret, err = F.build(rows, Tok())
    assert pos[0].tolist() == [4, 5, 6, 7]  # P - 1 + t, P = 5
    assert err.tolist() == [[0, 0, 0, 0], [0, 0, 1, 1], [0, 0, 0, 1]]  # an error among o_<t
    assert ret.tolist() == [[1] * 4, [-1] * 4, [-1] * 4]
    assert torch.equal(tokens[1, 5:9], torch.tensor(rows[1]["response_ids"]))


def _vpt_returns(out_dir):
    from megatron_s3ac.trainer.step.batch import collate
    from megatron_s3ac.trainer.step.trainer import Trainer
    from megatron_s3ac.trainer.stages.value_pretrain import value_pretrain

    tr = Trainer(load_config(None, SMALL + ["actor_layout.ep=1", f"train.out_dir={out_dir}",
                                            "value_pretrain.batch_size=8", "value_pretrain.epochs=1"]))
    g = torch.Generator().manual_seed(1)
    rows = [{"prompt_ids": p.ids, "response_ids": torch.randint(3, 15, (n,), generator=g).tolist(), "reward": -1.0}
            for p, n in zip(tr.prompts[:8], (1, 2, 3, 4, 4, 3, 2, 1))]
    for r in rows:  # a per-token target unlike the reward: +t
        r["returns"] = [float(t) for t in range(len(r["response_ids"]))]
    with torch.no_grad():
        v0 = tr.critic_values(collate([dict(r, logprobs=[0.0] * len(r["response_ids"]), pid=0) for r in rows],
                                      tr.pad_to))
    hist = []
    value_pretrain(tr, rows, log=hist.append)
    err = None
    try:
        value_pretrain(tr, [dict(rows[0], returns=[0.0, 0.0])], log=None)
    except ValueError as e:
        err = str(e)
    return v0, rows, hist[0]["vpt/value_loss"], err


def test_value_pretrain_fits_per_token_returns_when_given(tmp_path):
    v0, rows, loss0, err = run_distributed(_vpt_returns, 1, str(tmp_path))[0]
    # the first step's loss is on the untrained critic: 1/2 mean over tokens (V0 - target)^2 (one mini-batch)
    want = [0.5 * (float(v0[i, t]) - r["returns"][t]) ** 2 for i, r in enumerate(rows)
            for t in range(len(r["response_ids"]))]
    assert abs(loss0 - sum(want) / len(want)) < 1e-4 * max(1.0, sum(want) / len(want))
    assert err is not None and "2 returns for 1 response tokens" in err
