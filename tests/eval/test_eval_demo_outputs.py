"""s3ac-eval on what the CPU demo writes (hf_<tag>/ saved by the engine + heldout.jsonl with
prompt_ids): it used to exit 0 with avg@k 0.0 because the model had no tokenizer files and
transformers' empty stand-in decoded every response to "". Now: the demo's character vocabulary is
saved as an HF tokenizer, the reward comes from the file or the CLI refuses to guess, and undecodable
responses stop the evaluation (exit 2, no report).

The model is a demo-architecture model (tiny_arithmetic_hf_config) fitted for a few seconds on 24
one-digit sums, so it answers most of them: a score of 0 here is the bug, not the model."""
import json
import os

import pytest
import torch

from megatron_s3ac.eval.benchmarks import EvalInputError, load_benchmark
from megatron_s3ac.eval.cli import main
from megatron_s3ac.eval.runner import BenchmarkSpec, resolve_reward
from megatron_s3ac.tasks.arithmetic import arithmetic_reward
from megatron_s3ac.data.char_tokenizer import save_char_tokenizer
from megatron_s3ac.data.prompts import EOS, PAD, CharVocab
from megatron_s3ac.tasks.arithmetic import arithmetic_prompts, tiny_arithmetic_hf_config

N_PROMPTS = 24


def _demo_like(out, fit_steps: int):
    """(hf_final dir without tokenizer files, heldout rows as the demo writes them, the model)."""
    from transformers import AutoModelForCausalLM

    vocab = CharVocab()
    prompts = arithmetic_prompts(N_PROMPTS, 9, seed=3)
    threads = torch.get_num_threads()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        torch.set_num_threads(1)  # two threads on a loaded 2-core machine are slower than one
        model = AutoModelForCausalLM.from_config(tiny_arithmetic_hf_config())
        seqs = [p.ids + vocab.encode(p.reference) + [EOS] for p in prompts]
        width = max(map(len, seqs))
        x = torch.tensor([s + [PAD] * (width - len(s)) for s in seqs])
        labels = torch.tensor([[-100] * len(p.ids) + s[len(p.ids):] + [-100] * (width - len(s))
                               for p, s in zip(prompts, seqs)])
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(fit_steps):  # 80 steps: ~8 s of one core; loss 2.6 -> ~0.3
            loss = model(input_ids=x, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        torch.set_num_threads(threads)
    model.eval()
    hf = str(out / "hf_final")
    model.save_pretrained(hf)  # as demo.export_eval_inputs does: weights + config, no tokenizer
    rows = [{"prompt": p.text, "answer": p.reference, "prompt_ids": list(p.ids)} for p in prompts]
    return hf, rows, model


@pytest.fixture(scope="module")
def demo_like(tmp_path_factory):
    """A random demo-architecture model: enough for the refusals."""
    return _demo_like(tmp_path_factory.mktemp("cpu_demo_random"), fit_steps=0)


@pytest.fixture(scope="module")
def demo_fitted(tmp_path_factory):
    """A fitted one: for the score itself."""
    return _demo_like(tmp_path_factory.mktemp("cpu_demo_fitted"), fit_steps=80)


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def _greedy_reference(model, rows) -> float:
    """Independent score: HF generate (greedy), CharVocab decode, the arithmetic reward."""
    vocab, hits = CharVocab(), 0
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["prompt_ids"]])
            out = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=EOS, pad_token_id=PAD)
            hits += arithmetic_reward(vocab.decode(out[0, ids.shape[1]:].tolist()), r["answer"]) > 0
    return hits / len(rows)


def _eval(hf, bench, tmp_path, *extra):
    out = tmp_path / "report.json"
    rc = main(["--model", hf, "--bench", f"heldout={bench}", "--k", "1", "--temperature", "0",
               "--max-new-tokens", "4", "--out", str(out), *extra])
    return rc, (json.loads(out.read_text()) if out.exists() else None)


def test_model_without_tokenizer_is_refused(demo_like, tmp_path, capsys):
    hf, rows, _ = demo_like
    bench = _write(tmp_path / "heldout.jsonl", [dict(r, reward="arithmetic") for r in rows])
    rc, report = _eval(hf, bench, tmp_path)
    assert rc == 2 and report is None
    assert "no tokenizer files" in capsys.readouterr().err


def test_demo_outputs_score_like_the_model(demo_fitted, tmp_path):
    """With the tokenizer saved next to the model and the reward named by the file, s3ac-eval's greedy
    avg@1 equals an independent HF-generate + CharVocab + reward loop, and is far from 0."""
    hf, rows, model = demo_fitted
    tmp_hf = tmp_path / "hf_final"
    import shutil

    shutil.copytree(hf, tmp_hf)
    save_char_tokenizer(CharVocab(), str(tmp_hf))
    bench = _write(tmp_path / "heldout.jsonl", [dict(r, reward="arithmetic") for r in rows])
    rc, report = _eval(str(tmp_hf), bench, tmp_path, "--save-samples")
    assert rc == 0
    b = report["benchmarks"]["heldout"]
    expected = _greedy_reference(model, rows)
    assert expected >= 0.4  # the fitted model answers; the old silent 0.0 would fail below
    assert b["avg_at_k"] == pytest.approx(expected)
    assert b["num_prompts"] == N_PROMPTS and all(s["responses"][0] for s in b["samples"])


def test_pretokenized_set_without_reward_is_refused(demo_like, tmp_path, capsys):
    hf, rows, _ = demo_like
    tmp_hf = tmp_path / "hf"
    import shutil

    shutil.copytree(hf, tmp_hf)
    save_char_tokenizer(CharVocab(), str(tmp_hf))
    bench = _write(tmp_path / "heldout.jsonl", rows)
    rc, report = _eval(str(tmp_hf), bench, tmp_path)
    assert rc == 2 and report is None
    assert "refusing to guess" in capsys.readouterr().err
    # the caller may name it ...
    rc, report = _eval(str(tmp_hf), bench, tmp_path, "--reward", "arithmetic")
    assert rc == 0 and report["benchmarks"]["heldout"]["num_prompts"] == N_PROMPTS
    # ... or a sidecar does; a contradicting --reward is refused
    with open(bench + ".meta.json", "w") as f:
        json.dump({"reward": "arithmetic"}, f)
    rc, report2 = _eval(str(tmp_hf), bench, tmp_path)
    assert rc == 0 and report2["benchmarks"]["heldout"]["avg_at_k"] == report["benchmarks"]["heldout"]["avg_at_k"]
    (tmp_path / "report.json").unlink()
    rc, report = _eval(str(tmp_hf), bench, tmp_path, "--reward", "math")
    assert rc == 2 and report is None and "declares 'arithmetic'" in capsys.readouterr().err


def test_undecodable_responses_are_refused(demo_like, tmp_path, capsys):
    """A tokenizer that does not cover the model's vocabulary (here: only digits 0-3) cannot decode its
    answers: exit 2, nothing written, instead of scoring garbled text."""
    hf, rows, _ = demo_like
    small = save_char_tokenizer(CharVocab("0123"), str(tmp_path / "small_tok"))
    bench = _write(tmp_path / "heldout.jsonl", [dict(r, reward="arithmetic") for r in rows])
    rc, report = _eval(hf, bench, tmp_path, "--tokenizer", small)
    assert rc == 2 and report is None
    assert "outside its vocabulary" in capsys.readouterr().err


def test_empty_stand_in_tokenizer_is_refused_in_python(demo_like):
    """evaluate() itself refuses the stand-in transformers builds for a directory without tokenizer
    files (a Qwen2 tokenizer with an empty vocabulary), whatever the caller."""
    from transformers import AutoTokenizer

    from megatron_s3ac.eval.runner import evaluate
    from megatron_s3ac.rollout.base import SamplingParams
    from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine

    hf, rows, _ = demo_like
    stand_in = AutoTokenizer.from_pretrained(hf)
    engine = CPUEngine.from_pretrained(hf, tokenizer=stand_in)
    with pytest.raises(EvalInputError, match="cannot decode"):
        evaluate(engine, stand_in, {"heldout": BenchmarkSpec(rows, reward="arithmetic")}, k=1,
                 params=SamplingParams(temperature=0, max_new_tokens=4))


def test_declared_reward_rules(tmp_path):
    rows = [{"prompt": "1+2=", "answer": "3", "prompt_ids": [1, 4, 13, 5, 14]}]
    path = _write(tmp_path / "b.jsonl", rows)
    bench = load_benchmark("b", path)
    assert bench.reward is None and bench.pretokenized
    with pytest.raises(EvalInputError, match="refusing to guess"):
        resolve_reward(BenchmarkSpec(path), bench)
    assert resolve_reward(BenchmarkSpec(path, reward="arithmetic"), bench) == "arithmetic"
    with pytest.raises(EvalInputError, match="unknown reward"):
        resolve_reward(BenchmarkSpec(path, reward="no_such_reward"), bench)
    # text rows keep the documented math default
    text = load_benchmark("t", [{"problem": "1+2?", "answer": "3"}])
    assert resolve_reward(BenchmarkSpec(None), text) == "math"
    # rows naming two rewards, or rows vs sidecar disagreeing: refused at load
    with pytest.raises(EvalInputError, match="different rewards"):
        load_benchmark("m", [dict(rows[0], reward="math"), dict(rows[0], reward="arithmetic")])
    path2 = _write(tmp_path / "c.jsonl", [dict(rows[0], reward="math")])
    with open(path2 + ".meta.json", "w") as f:
        json.dump({"reward": "arithmetic"}, f)
    with pytest.raises(EvalInputError, match="says 'arithmetic'"):
        load_benchmark("c", path2)
    os.remove(path2 + ".meta.json")
    assert load_benchmark("c", path2).reward == "math"


def test_demo_export_is_scored_by_the_plain_cli(demo_fitted, tmp_path):
    """trainer.stages.demo.export_eval_inputs (the demo's own writer) + the issue's exact command
    `s3ac-eval --model OUT/hf_final --bench heldout=OUT/heldout.jsonl` (no --reward, no --tokenizer):
    exit 0 and the independent greedy score."""
    import types

    from transformers import AutoModelForCausalLM

    from megatron_s3ac.config import load_config
    from megatron_s3ac.data.prompts import Prompt
    from megatron_s3ac.trainer.stages.demo import export_eval_inputs

    hf, rows, model = demo_fitted
    cfg = load_config(None, ["model.tiny=arithmetic_moe"])
    tr = types.SimpleNamespace(rank=0, cfg=cfg, vocab=CharVocab(),
                               engine=types.SimpleNamespace(model=AutoModelForCausalLM.from_pretrained(hf)),
                               eval_prompts=[Prompt(r["prompt_ids"], r["prompt"], r["answer"]) for r in rows])
    export_eval_inputs(tr, str(tmp_path), "final")
    written = [json.loads(line) for line in open(tmp_path / "heldout.jsonl")]
    assert all(r["reward"] == "arithmetic" for r in written) and len(written) == N_PROMPTS
    out = tmp_path / "report.json"
    rc = main(["--model", str(tmp_path / "hf_final"), "--bench", f"heldout={tmp_path / 'heldout.jsonl'}",
               "--k", "1", "--temperature", "0", "--max-new-tokens", "4", "--out", str(out)])
    assert rc == 0
    assert json.loads(out.read_text())["benchmarks"]["heldout"]["avg_at_k"] == pytest.approx(
        _greedy_reference(model, rows))
