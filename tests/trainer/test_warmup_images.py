"""Issue 27: the supervised warm-up (trainer/stages/warmup.py) on the multimodal miniature's image prompts. Its samples
carry ``Prompt.images`` into the actor's forward (checked by a hook on the actor's vision tower: one call per
micro-batch, fed exactly the prompts' pixel rows) and their answers are the checkpoint's HF tokenizer ids + its
EOS (reference: the tokenizer called directly); a few steps at the demo's learning rate lower the per-token
SFT loss (first steps vs last steps, summed NLL / answer tokens from the warm-up's own loss)."""
import os

import torch

from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.config import load_config

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
STEPS = 12


def _warmup(paths, mcore, out_dir):
    from megatron_s3ac.models.vision import vision_of
    from megatron_s3ac.trainer.stages import warmup as W
    from megatron_s3ac.trainer.step.trainer import Trainer

    m = paths["model"]
    cfg = load_config(os.path.join(ROOT, "examples", "cpu_demo_vl.yaml"), [
        f"model.hf_config={m}", f"model.engine_hf_dir={m}", f"model.actor_init={mcore}", f"data.path={paths['train']}",
        f"eval.benchmarks.heldout={paths['heldout_mathvista']}", f"train.out_dir={out_dir}", "actor_layout.ep=1",
        "algo.name=grpo_x", "demo.warmup_batch=8", f"demo.warmup_max_steps={STEPS}", f"demo.warmup_eval_every={STEPS}",
        "demo.target_pass_rate=1.0", "train.tensorboard=false", "train.progress=false"])
    tr = Trainer(cfg)
    res = {"samples_ok": True, "tower_rows": [], "batch_rows": [], "nll": [], "tokens": []}
    for i in range(len(tr.prompts)):  # the answer: the checkpoint's tokenizer + its EOS, the image with it
        s, p = W.warmup_sample(tr, i), tr.prompts[i]
        want = tr.vocab(p.reference, add_special_tokens=False)["input_ids"] + [tr.vocab.eos_token_id]
        res["samples_ok"] &= s["response_ids"] == want and s["images"] is p.images and p.images is not None
    tower = vision_of(tr.actor)
    hook = tower.register_forward_hook(lambda mod, args, out: res["tower_rows"].append(int(args[0].pixel_values.shape[0])))
    real = W.run_minibatches

    def spy(model, opt, batch, groups, loss_fn, micro):
        res["batch_rows"].append(sum(int(im.pixel_values.shape[0]) for im in batch.images))
        res["tokens"].append(float(batch.mask.sum()))
        out = list(real(model, opt, batch, groups, loss_fn, micro))
        res["nll"].append(sum(float(o["nll"]) for r in out for o in r.outputs))
        return out

    W.run_minibatches = spy
    try:
        res["result"] = W.supervised_warmup(tr, lambda m: None)
    finally:
        W.run_minibatches = real
        hook.remove()
    tr.close()
    return res


def test_warmup_on_image_prompts_feeds_the_images_and_lowers_the_sft_loss(tmp_path):
    from megatron_s3ac.convert import hf_to_mcore
    from megatron_s3ac.tasks.vision import save_vision_miniature

    paths = save_vision_miniature(str(tmp_path / "data"), num_prompts=16, eval_prompts=2)
    mcore = str(tmp_path / "mcore")
    hf_to_mcore(paths["model"], mcore, progress=False)
    r = run_distributed(_warmup, 1, paths, mcore, str(tmp_path / "out"))[0]
    assert r["samples_ok"]
    assert len(r["nll"]) == STEPS and r["result"]["steps"] == STEPS
    # every warm-up batch's images went through the actor's tower: the forwards' pixel rows sum to the batches'
    assert all(n > 0 for n in r["batch_rows"])
    assert sum(r["tower_rows"]) == sum(r["batch_rows"])
    per_tok = [n / t for n, t in zip(r["nll"], r["tokens"])]
    first, last = sum(per_tok[:3]) / 3, sum(per_tok[-3:]) / 3
    assert last < 0.8 * first, per_tok
