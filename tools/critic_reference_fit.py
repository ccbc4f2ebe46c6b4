"""Controlled check of the critic on a chain-task run (issue 29): can a plain torch critic learn what ours does not?

    python tools/critic_reference_fit.py RUN_DIR [--rows 4096] [--epochs 2] [--lr 1e-3] [--batch 128] [--fits probe,adam_frozen_attn,adam_full] [--targets R,err] [--privileged] [--hf DIR --coverage FILE]

Reads RUN_DIR/stages/coverage/coverage.jsonl (the value-pretraining data) and RUN_DIR/hf_warmup (the RL start
policy, which initialises the critic) and fits, on the *same positions* value pretraining uses (response token t
is valued at sequence position P - 1 + t, i.e. from the prefix prompt + o_<t; trainer.step.batch.collate's idx):

- ``probe``: closed-form ridge regression of the target on the frozen backbone's final hidden states (what a
  linear value head on the untouched backbone can reach at best);
- ``adam_frozen_attn`` / ``adam_full``: the HF backbone + a linear head (init N(0, 1/(H+1)), bias 0) trained
  with Adam at ``--lr``, ``--epochs`` epochs of ``--batch`` rows, token-mean 1/2 (V - y)^2, grad clip 10, with
  attention + its pre-norm + router frozen (value pretraining's default) or everything trained;

each for two targets: ``R`` (the lambda = 1 return, the terminal reward of every token: value pretraining's
target) and ``err`` (1 if an earlier token o_<t already left the chain, from the reference answer:
``tasks.chain.first_error``'s notion, a known function of the visible prefix). EV is 1 - Var(y - V) / Var(y)
over all tokens of a held-out quarter of the rows, per epoch (``ev_per_epoch``; ``train_ev_per_epoch`` on as many
training rows: the gap between the two is overfitting, BPCO's caveat that the privileged critic overfits sooner on a
small data set; ``best_epoch`` where the held-out EV peaks). Also prints the "oracle" EV on R of the critic that knows
only ``err`` (V = -1 after an error, else the per-position mean return): the ceiling such a critic could reach.
Prints JSON. CPU only, a few minutes on 4096 rows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

CLIP = 10.0


def _rows(path: str, n: int, seed: int) -> list[dict]:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    g = torch.Generator().manual_seed(seed)
    return [rows[i] for i in torch.randperm(len(rows), generator=g)[:n].tolist()]


def _reference_ids(prompt_ids: list[int], tok) -> list[int]:
    """The cumsum chain's answer token ids for a prompt '<bos>d1..dn=' (running sums mod 10)."""
    digits = [int(tok.convert_ids_to_tokens(i)) for i in prompt_ids if tok.convert_ids_to_tokens(i).isdigit()]
    s, out = 0, []
    for d in digits:
        s = (s + d) % 10
        out.append(tok.convert_tokens_to_ids(str(s)))
    return out


def build(rows: list[dict], tok, privileged: bool = False):
    """tokens [n, L], pos [n, T] (P - 1 + t), mask [n, T], R [n, T], err [n, T] (error among o_<t).
    ``privileged``: the critic's view of model.critic_privileged=answer: prompt + the reference answer + "=" +
    response (trainer.step.privileged's character template), positions shifted by the block."""
    n = len(rows)
    blocks = [(_reference_ids(r["prompt_ids"], tok) + [tok.convert_tokens_to_ids("=")]) if privileged else []
              for r in rows]
    P = [len(r["prompt_ids"]) + len(b) for r, b in zip(rows, blocks)]
    Rl = [len(r["response_ids"]) for r in rows]
    T, L = max(Rl), max(p + r for p, r in zip(P, Rl))
    tokens = torch.zeros(n, L, dtype=torch.long)
    pos = torch.zeros(n, T, dtype=torch.long)
    mask, ret, err = torch.zeros(n, T), torch.zeros(n, T), torch.zeros(n, T)
    for i, r in enumerate(rows):
        seq = r["prompt_ids"] + blocks[i] + r["response_ids"]
        tokens[i, :len(seq)] = torch.tensor(seq)
        ref = _reference_ids(r["prompt_ids"], tok)
        resp = r["response_ids"]
        # first answer token off the chain (None: the answer is the chain; what follows it is eos or pad)
        fe = next((t for t in range(len(ref)) if t >= len(resp) or resp[t] != ref[t]), None)
        if r["reward"] > 0 and fe is not None:
            raise ValueError(f"a passing row is off the chain at token {fe}: {r}")
        for t in range(len(resp)):
            pos[i, t] = P[i] - 1 + t  # value of token t is read where o_<t is the whole visible response
            mask[i, t] = 1.0
            ret[i, t] = float(r["reward"])
            err[i, t] = float(fe is not None and fe < t)
    return tokens, pos, mask, ret, err


def ev(y, v, m) -> float:
    sel = m.bool()
    y, v = y[sel].double(), v[sel].double()
    return float(1 - (y - v).var(unbiased=False) / y.var(unbiased=False))


def hidden(model, tokens, pos, bs=512):
    out = []
    with torch.no_grad():
        for s in range(0, len(tokens), bs):
            h = model.model(input_ids=tokens[s:s + bs]).last_hidden_state
            out.append(torch.gather(h, 1, pos[s:s + bs, :, None].expand(-1, -1, h.shape[-1])))
    return torch.cat(out)


def probe(htr, ytr, mtr, hte, yte, mte, lam=1e-3) -> float:
    x = torch.cat([htr[mtr.bool()], torch.ones(int(mtr.sum()), 1)], 1).double()
    w = torch.linalg.solve(x.T @ x + lam * torch.eye(x.shape[1], dtype=x.dtype), x.T @ ytr[mtr.bool()].double())
    xe = torch.cat([hte, torch.ones(*hte.shape[:2], 1)], -1).double()
    return ev(yte, (xe @ w).float(), mte)


def adam_fit(path, data, target, train_idx, test_idx, lr, epochs, batch, freeze, seed):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).model
    H = model.config.hidden_size
    head = torch.nn.Linear(H, 1)
    with torch.no_grad():
        head.weight.normal_(0.0, 1.0 / (H + 1))
        head.bias.zero_()
    for name, p in model.named_parameters():
        if freeze and any(k in "." + name for k in (".self_attn.", ".input_layernorm.", ".mlp.gate.")):
            p.requires_grad_(False)
    params = [p for p in list(model.parameters()) + list(head.parameters()) if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    tokens, pos, mask, y = data[0], data[1], data[2], target
    g = torch.Generator().manual_seed(seed)

    def values(idx):
        h = model(input_ids=tokens[idx]).last_hidden_state
        h = torch.gather(h, 1, pos[idx, :, None].expand(-1, -1, H))
        return head(h).squeeze(-1)

    curve, train_curve = [], []
    seen = train_idx[:len(test_idx)]  # as many training rows as held-out ones, for the train-EV curve
    step = 0
    for _ in range(epochs):
        perm = train_idx[torch.randperm(len(train_idx), generator=g)]
        for s in range(0, len(perm) - batch + 1, batch):
            idx = perm[s:s + batch]
            v = values(idx)
            m = mask[idx]
            loss = (0.5 * (v - y[idx]) ** 2 * m).sum() / m.sum()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, CLIP)
            opt.step()
            step += 1
        with torch.no_grad():
            vt = torch.cat([values(test_idx[s:s + 512]) for s in range(0, len(test_idx), 512)])
            vr = torch.cat([values(seen[s:s + 512]) for s in range(0, len(seen), 512)])
        curve.append(round(ev(y[test_idx], vt, mask[test_idx]), 4))
        train_curve.append(round(ev(y[seen], vr, mask[seen]), 4))
    # overfitting shows as the gap: EV on rows it trained on rising while the held-out EV stalls or falls
    return {"steps": step, "ev_per_epoch": curve, "train_ev_per_epoch": train_curve,
            "best_epoch": 1 + max(range(len(curve)), key=curve.__getitem__)}


def ours(run: str, rows: list[dict], targets: dict, out_dir: str) -> dict:
    """This project's value pretraining (megatron critic from the run's warm-up actor, the run's config at one
    rank) on ``rows`` with per-token ``targets[name]`` [n, T]; run under ``torchrun --nproc-per-node 1``.
    Returns per target the EV of its last 10 steps (each step's own mini-batch, as value_pretrain logs it)."""
    from megatron_s3ac.convert.carried import load_model
    from megatron_s3ac.config import load_config
    from megatron_s3ac.trainer.step.trainer import Trainer
    from megatron_s3ac.trainer.stages.value_pretrain import value_pretrain

    cfg = load_config(os.path.join(run, "config.yaml"), ["actor_layout.ep=1", f"train.out_dir={out_dir}",
                                                           "model.actor_init=null", "model.critic_init=null",
                                                           "train.tensorboard=false", "train.progress=false"])
    tr = Trainer(cfg)
    res = {}
    for name, y in targets.items():
        with tr.model_scope("actor"):
            load_model(tr.actor, os.path.join(run, "stages", "warmup", "actor"))
        tr.init_critic_from_actor()
        hist = []
        summ = value_pretrain(tr, [dict(r, returns=y[i, :len(r["response_ids"])].tolist())
                                   for i, r in enumerate(rows)], log=hist.append)
        res[name] = {"steps": summ["vpt/steps"],
                     "ev_last10": round(sum(h["vpt/explained_variance"] for h in hist[-10:]) / 10, 4)}
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run")
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fits", default="probe,adam_frozen_attn,adam_full")
    p.add_argument("--targets", default="R,err", help="comma list of R, err")
    p.add_argument("--privileged", action="store_true", help="the critic sees the reference answer (prompt + "
                   "answer + '=' + response, model.critic_privileged=answer)")
    p.add_argument("--hf", help="the RL start policy's HF dir (default RUN/hf_warmup)")
    p.add_argument("--coverage", help="the coverage jsonl (default RUN/stages/coverage/coverage.jsonl)")
    p.add_argument("--ours", action="store_true", help="also (only) run this project's value pretraining on the same "
                   "targets (all rows; under torchrun --nproc-per-node 1)")
    a = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = a.hf or os.path.join(a.run, "hf_warmup")
    cov = a.coverage or os.path.join(a.run, "stages", "coverage", "coverage.jsonl")
    for f in (hf, cov):
        if not os.path.exists(f):
            print(f"critic_reference_fit: {f} not found (a pipeline run dir with coverage data)", file=sys.stderr)
            return 2
    tok = AutoTokenizer.from_pretrained(hf)
    rows = _rows(cov, a.rows, a.seed)
    data = build(rows, tok, a.privileged)
    tokens, pos, mask, ret, err = data
    n = len(rows)
    test_idx, train_idx = torch.arange(n)[: n // 4], torch.arange(n)[n // 4:]
    # the oracle that knows only "an earlier token is wrong": -1 after an error, else the per-position mean return
    ok = (1 - err) * mask
    pm = (ret * ok).sum(0) / ok.sum(0).clamp(min=1)
    oracle = torch.where(err.bool(), torch.full_like(ret, -1.0), pm.expand_as(ret))
    out = {"rows": n, "pass_rate": round(float((ret[:, 0] > 0).float().mean()), 4),
           "oracle_err_ev_on_R": round(ev(ret, oracle, mask), 4)}
    fits = a.fits.split(",")
    if a.ours:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            out["ours"] = ours(a.run, rows, {tn: y for tn, y in (("R", ret), ("err", err))
                                             if tn in a.targets.split(",")}, d)
        fits = []
    if "probe" in fits:
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
        h = hidden(model, tokens, pos)
        out["probe"] = {name: round(probe(h[train_idx], y[train_idx], mask[train_idx], h[test_idx], y[test_idx],
                                          mask[test_idx]), 4) for name, y in (("R", ret), ("err", err))}
    for name, freeze in (("adam_frozen_attn", True), ("adam_full", False)):
        if name in fits:
            out[name] = {tn: adam_fit(hf, data, y, train_idx, test_idx, a.lr, a.epochs, a.batch, freeze, a.seed)
                         for tn, y in (("R", ret), ("err", err)) if tn in a.targets.split(",")}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
