"""tools/build_coverage_data.py --config TRAINER.yaml: engine, prompts, reward and response length come
from the trainer config (rollout.max_new_tokens, not a 1,024-token default); bad input exits 2 with
nothing written. The pipeline's coverage stage runs the same function (trainer.stages.coverage.build_coverage;
the slow pipeline test compares the two files)."""
import json
import os
import sys

import pytest
import torch

from megatron_s3ac.rollout.rewards import register_reward
from megatron_s3ac.data.prompts import EOS, CharVocab
from megatron_s3ac.tasks.arithmetic import arithmetic_prompts, tiny_arithmetic_hf_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "examples", "cpu_demo.yaml")
sys.path.insert(0, os.path.join(ROOT, "tools"))


@register_reward("test_coverage_len_parity", isolate=False)
def len_parity(response: str, reference: str) -> float:
    """Varies on a random model's output (the arithmetic reward is -1 almost everywhere)."""
    return 1.0 if len(response) % 2 else -1.0


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    """Two random demo-architecture policies saved as the pipeline's warm-up saves its snapshots."""
    from transformers import AutoModelForCausalLM

    from megatron_s3ac.data.char_tokenizer import save_char_tokenizer

    out = []
    for seed in (0, 1):
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(tiny_arithmetic_hf_config())
        d = str(tmp_path_factory.mktemp(f"policy{seed}"))
        model.save_pretrained(d)
        save_char_tokenizer(CharVocab(), d)
        out.append(d)
    return out


COMMON = ["data.num_prompts=60", "data.eval_prompts=10", "pipeline.coverage_prompts=6", "pipeline.coverage_k=2",
          "rollout.reward=test_coverage_len_parity"]


def _run(*args):
    import build_coverage_data

    return build_coverage_data.main(list(args))


def test_rollouts_at_the_configs_response_length(policies, tmp_path):
    out = str(tmp_path / "cov.jsonl")
    assert _run("--config", DEMO, "--checkpoints", *policies, "--out", out, *COMMON, "rollout.max_new_tokens=9") == 0
    rows = [json.loads(line) for line in open(out)]
    assert len(rows) == 2 * 6 * 2 and [r["source"] for r in rows] == [policies[0]] * 12 + [policies[1]] * 12
    lens = [len(r["response_ids"]) for r in rows]
    # the RL length: nothing longer, and the random policies run into it (no EOS sampled)
    assert max(lens) == 9 and sum(n == 9 for n in lens) >= len(rows) // 2
    vocab = CharVocab()
    held_out = {p.text for p in arithmetic_prompts(10, 99, 2)}
    train = {tuple(p.ids) for p in arithmetic_prompts(60, 99, 1, exclude=held_out)}
    assert len({tuple(r["prompt_ids"]) for r in rows}) == 6 and {tuple(r["prompt_ids"]) for r in rows} <= train
    for r in rows:  # the reward of the decoded response, recomputed here
        text = vocab.decode([t for t in r["response_ids"] if t != EOS])
        assert r["reward"] == len_parity(text, "")
    assert {r["reward"] for r in rows} == {1.0, -1.0}
    out5 = str(tmp_path / "cov5.jsonl")
    assert _run("--config", DEMO, "--checkpoints", policies[0], "--out", out5, *COMMON, "rollout.max_new_tokens=5") == 0
    assert max(len(json.loads(line)["response_ids"]) for line in open(out5)) == 5


def test_bad_input_exits_2_and_writes_nothing(policies, tmp_path, capsys):
    out = str(tmp_path / "cov.jsonl")
    assert _run("--config", DEMO, "--checkpoints", policies[0], str(tmp_path / "nope"), "--out", out, *COMMON) == 2
    assert "does not exist" in capsys.readouterr().err and not os.path.exists(out)
    assert _run("--config", DEMO, "--out", out, *COMMON, "rollout.k=0") == 2
    assert "rollout.k" in capsys.readouterr().err and not os.path.exists(out)
    # no --checkpoints, no pipeline.policies and no warm-up snapshots to fall back on
    assert _run("--config", DEMO, "--out", out, "--warmup-dir", str(tmp_path), *COMMON) == 2
    assert "holds no warm-up snapshots" in capsys.readouterr().err and not os.path.exists(out)
