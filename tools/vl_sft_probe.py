"""Learnability probe of the multimodal miniature (issue 27), outside the trainer: transformers'
Qwen3_5MoeForConditionalGeneration of ``DATA/model`` trained by cross-entropy on the answers + EOS of
``DATA/train.jsonl`` (AdamW, batch 32), greedy pass rate on ``DATA/heldout.jsonl`` every 50 steps.
The figures of docs/data.md ("What was tried"). One process, CPU:

    OMP_NUM_THREADS=1 python tools/vl_sft_probe.py runs/cpu_demo_vl/data --trainable --steps 400
"""
import argparse
import sys
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data")
    ap.add_argument("--trainable", action="store_true", help="train the vision tower too (default: frozen)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=50)
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer, Qwen3_5MoeForConditionalGeneration

    from megatron_s3ac.data.prompts import VisionProcessor, load_math_prompts

    m = a.data + "/model"
    tok, vp = AutoTokenizer.from_pretrained(m), VisionProcessor.from_pretrained(m)
    train, _ = load_math_prompts(a.data + "/train.jsonl", tok, 64, False, vision=vp)
    held, _ = load_math_prompts(a.data + "/heldout.jsonl", tok, 64, False, vision=vp)
    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(m, dtype=torch.float32)
    img = model.config.image_token_id
    for n, p in model.named_parameters():
        if "visual" in n:
            p.requires_grad_(a.trainable)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=a.lr, weight_decay=0.0)
    eos = tok.eos_token_id

    def batch(ps, answers=True):
        seqs = [p.ids + (tok(p.reference, add_special_tokens=False)["input_ids"] + [eos] if answers else []) for p in ps]
        L = max(map(len, seqs))
        ids = torch.tensor([s + [0] * (L - len(s)) for s in seqs])
        lab = ids.clone()
        for i, (s, p) in enumerate(zip(seqs, ps)):
            lab[i, :len(p.ids)] = -100
            lab[i, len(s):] = -100
        return ids, lab, dict(pixel_values=torch.cat([p.images.pixel_values for p in ps]),
                              image_grid_thw=torch.cat([p.images.image_grid_thw for p in ps]),
                              mm_token_type_ids=(ids == img).int())

    @torch.no_grad()
    def evaluate():
        model.eval()
        ids, _, kw = batch(held, answers=False)  # the prompts all have one length (32 image tokens + "=")
        out = model.generate(input_ids=ids, **kw, max_new_tokens=3, do_sample=False, eos_token_id=eos, pad_token_id=0)
        ok = 0
        for p, o in zip(held, out[:, ids.shape[1]:].tolist()):
            ok += tok.decode(o[:o.index(eos)] if eos in o else o) == p.reference
        model.train()
        return ok / len(held)

    g, t0 = torch.Generator().manual_seed(0), time.time()
    for step in range(1, a.steps + 1):
        ids, lab, kw = batch([train[i] for i in torch.randint(0, len(train), (a.batch,), generator=g).tolist()])
        loss = model(input_ids=ids, labels=lab, **kw).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % a.eval_every == 0:
            print(f"step {step} loss {loss.item():.3f} heldout greedy {evaluate():.3f} t {time.time() - t0:.0f}s",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
