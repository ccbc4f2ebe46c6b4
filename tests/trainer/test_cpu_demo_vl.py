"""examples/cpu_demo_vl.yaml with the miniature it documents: the config loads and validates, its data builds into
image prompts (expanded ids + ImageInputs) through the trainer's own build_data, and the CPU engine serves them;
the held-out set in MathVista's layout loads as an image benchmark, rendered (eval.template) into exactly the
training prompts' ids; the engine stops on the tokenizer's EOS (what the warm-up ends its answers with)."""
import os

import pytest

from megatron_s3ac.eval.benchmarks import load_benchmark
from megatron_s3ac.rollout.base import SamplingParams
from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine
from megatron_s3ac.trainer.step.build import build_data
from megatron_s3ac.config import load_config
from megatron_s3ac.tasks.vision import save_vision_miniature

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_demo_config_data_and_engine(tmp_path):
    from transformers import AutoTokenizer

    from megatron_s3ac.eval.benchmarks import prompt_inputs
    from megatron_s3ac.data.prompts import VisionProcessor

    paths = save_vision_miniature(str(tmp_path / "data"), num_prompts=8, eval_prompts=4, convert=True, task="read_noisy")
    cfg = load_config(os.path.join(ROOT, "examples", "cpu_demo_vl.yaml"),
                      [f"model.hf_config={paths['model']}", f"model.engine_hf_dir={paths['model']}",
                       f"model.actor_init={paths['mcore']}", f"data.path={paths['train']}",
                       f"train.out_dir={tmp_path / 'run'}", f"eval.benchmarks.heldout={paths['heldout_mathvista']}"])
    assert os.path.isfile(os.path.join(paths["mcore"], "metadata.json"))  # the set-up's hf_to_mcore conversion
    data = build_data(cfg, use_daps=False)
    assert len(data.prompts) == 8 and all(p.images is not None for p in data.prompts)
    assert all(p.ids.count(90) == p.images.num_image_tokens(1) == 16 for p in data.prompts)
    eng = CPUEngine.from_pretrained(paths["model"], multimodal=True)
    out = eng.generate([p.ids for p in data.prompts[:2]], SamplingParams(temperature=1.0, max_new_tokens=3, seed=0),
                       n_samples=2, return_routed_experts=True, images=[p.images for p in data.prompts[:2]])
    assert all(s.images is data.prompts[i].images for i, g in enumerate(out) for s in g)
    bench = load_benchmark("mathvista", paths["heldout_mathvista"])
    assert len(bench.items) == 4 and all(len(it.images) == 1 and it.kind == "math" for it in bench.items)
    tok, vision = AutoTokenizer.from_pretrained(paths["model"]), VisionProcessor.from_pretrained(paths["model"])
    for it in bench.items:
        ids, imgs = prompt_inputs(it, tok, cfg.eval.template, vision)
        assert ids == data.prompts[0].ids and imgs.num_image_tokens(1) == 16
    assert eng.eos_token_ids == {tok.eos_token_id} and tok.eos_token_id is not None
