"""Issue 27: coverage data and value pretraining on image prompts (the multimodal miniature).

Coverage (trainer.stages.coverage.generate_coverage, the pipeline's coverage stage): the CPU engine is loaded multimodal
and given each prompt's images; greedy rows equal transformers' own greedy generate of
Qwen3_5MoeForConditionalGeneration on the same pixels (the independent reference), and every row of an image
prompt records its ``prompt_index``. Value pretraining (trainer.stages.value_pretrain) takes those rows: the critic's
vision tower is fed exactly the rows' pixels (the prompts' ``ImageInputs``, by a hook on the tower), and rows
that do not belong to the trainer's prompts are refused naming the row."""
import json
import os

import pytest
import torch

from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.config import load_config

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
NEW = 3


@pytest.fixture(scope="module")
def miniature(tmp_path_factory):
    from megatron_s3ac.tasks.vision import save_vision_miniature

    root = tmp_path_factory.mktemp("coverage_images")
    return save_vision_miniature(str(root / "data"), num_prompts=6, eval_prompts=2), root


def _prompts(model_dir, path):
    from transformers import AutoTokenizer

    from megatron_s3ac.data.prompts import VisionProcessor, load_math_prompts

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts, _ = load_math_prompts(path, tok, 64, apply_chat_template=False,
                                   vision=VisionProcessor.from_pretrained(model_dir))
    return prompts, tok


def test_coverage_rows_of_image_prompts_match_transformers_greedy_and_name_their_prompt(miniature):
    from transformers import Qwen3_5MoeForConditionalGeneration

    from megatron_s3ac.models.tiny_qwen3_5 import VL_TOKENS
    from megatron_s3ac.trainer.stages.coverage import CoverageSettings, generate_coverage

    paths, root = miniature
    m = paths["model"]
    prompts, tok = _prompts(m, paths["train"])
    assert all(p.images is not None for p in prompts)
    out = str(root / "cov.jsonl")
    index = [5, 3, 0, 1, 2, 4][:len(prompts)]
    res = generate_coverage([m], prompts, CoverageSettings(k=1, max_new_tokens=NEW, temperature=0.0),
                            decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
                            score=lambda texts, refs: [1.0 if t == r else -1.0 for t, r in zip(texts, refs)],
                            out_path=out, prompt_index=index)
    rows = [json.loads(line) for line in open(out)]
    assert res["trajectories"] == len(rows) == len(prompts)
    hf = Qwen3_5MoeForConditionalGeneration.from_pretrained(m, dtype=torch.float32).eval()
    eos = tok.eos_token_id
    for j, (p, r) in enumerate(zip(prompts, rows)):
        assert r["prompt_ids"] == list(p.ids) and r["prompt_index"] == index[j]
        ids = torch.tensor([p.ids])
        with torch.no_grad():
            g = hf.generate(input_ids=ids, pixel_values=p.images.pixel_values, image_grid_thw=p.images.image_grid_thw,
                            mm_token_type_ids=(ids == VL_TOKENS["image_token_id"]).int(), max_new_tokens=NEW,
                            do_sample=False, eos_token_id=eos, pad_token_id=0)[0, ids.shape[1]:].tolist()
        want = g[:g.index(eos) + 1] if eos in g else g
        assert r["response_ids"] == want, (j, r["response_ids"], want)


def _vpt(paths, mcore, out_dir, rows):
    from megatron_s3ac.models.vision import vision_of
    from megatron_s3ac.trainer.step.trainer import Trainer
    from megatron_s3ac.trainer.stages.value_pretrain import attach_row_images, value_pretrain

    m = paths["model"]
    cfg = load_config(os.path.join(ROOT, "examples", "cpu_demo_vl.yaml"), [
        f"model.hf_config={m}", f"model.engine_hf_dir={m}", f"model.actor_init={mcore}", f"data.path={paths['train']}",
        f"eval.benchmarks.heldout={paths['heldout_mathvista']}", f"train.out_dir={out_dir}", "actor_layout.ep=1",
        "value_pretrain.epochs=2", "value_pretrain.batch_size=4", "train.tensorboard=false", "train.progress=false"])
    tr = Trainer(cfg)
    tower = vision_of(tr.critic, spare=True)
    fed = []
    hook = tower.register_forward_hook(lambda mod, args, out: fed.append(args[0].pixel_values.clone()))
    try:
        res = value_pretrain(tr, rows)
    finally:
        hook.remove()
    want = [tr.prompts[r["prompt_index"]].images.pixel_values for r in rows]
    errors = []
    for bad in ({**rows[0], "prompt_index": len(tr.prompts)}, {**rows[0], "prompt_ids": rows[0]["prompt_ids"][:-1]}):
        try:
            attach_row_images(tr.prompts, [rows[1], bad])
        except ValueError as e:
            errors.append(str(e))
    tr.close()
    fed_rows = sorted(tuple(x.flatten().tolist()) for t in fed for x in t.split(32))
    want_rows = sorted(tuple(x.flatten().tolist()) for t in want for x in t.split(32)) * 2  # two epochs
    return {"res": res, "fed_equal": fed_rows == sorted(want_rows), "n_fed": len(fed_rows), "n_want": len(want_rows),
            "errors": errors}


@pytest.mark.slow  # a Trainer (actor, critic, multimodal engine) on a gloo rank: minutes on 2 loaded cores
def test_value_pretraining_feeds_the_coverage_rows_images_to_the_critic(miniature):
    from megatron_s3ac.convert import hf_to_mcore

    paths, root = miniature
    mcore = str(root / "mcore")
    hf_to_mcore(paths["model"], mcore, progress=False)
    prompts, _ = _prompts(paths["model"], paths["train"])
    # coverage rows as the coverage stage writes them (prompt ids + the prompt's index, no pixels), rewards +-1
    rows = [{"prompt_ids": list(p.ids), "response_ids": [3 + i % 10, 1], "reward": 1.0 if i % 2 else -1.0,
             "source": "x", "prompt_index": i} for i, p in enumerate(prompts)]
    r = run_distributed(_vpt, 1, paths, mcore, str(root / "vpt"), rows)[0]
    assert r["res"]["vpt/steps"] == 2 * -(-len(rows) // 4)
    assert r["n_fed"] == r["n_want"] and r["fed_equal"]
    assert len(r["errors"]) == 2 and all("coverage row 1" in e for e in r["errors"]), r["errors"]
