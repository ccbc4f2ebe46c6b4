"""PeriodicEvaluator (what s3ac-train calls every N steps) and the s3ac-eval command line."""
import json
import os
import shutil

import pytest

from eval_fixtures import EXAMPLES, arithmetic_rows
from megatron_s3ac.eval.cli import main, model_directory, resolve_model_dir
from megatron_s3ac.eval.periodic import PeriodicEvaluator
from megatron_s3ac.eval.runner import BenchmarkSpec
from megatron_s3ac.rollout.base import SamplingParams


def test_periodic_evaluator(engine, tokenizer, tmp_path):
    ev = PeriodicEvaluator({"sums": BenchmarkSpec(arithmetic_rows(6), reward="arithmetic", template="raw")},
                           every_n_steps=10, k=4, params=SamplingParams(max_new_tokens=1), seed=0,
                           report_dir=str(tmp_path))
    assert [s for s in range(0, 31) if ev.should_run(s)] == [10, 20, 30]
    assert not PeriodicEvaluator({}, every_n_steps=0).should_run(10)

    first = ev.run(10, engine, tokenizer)
    assert set(first) == {"eval/sums/avg@4", "eval/sums/pass@4", "eval/sums/verifier_timeouts", "eval/average",
                          "eval/is_best"}
    assert first["eval/is_best"] == 1.0 and ev.best_step == 10
    second = ev.run(20, engine, tokenizer)  # same weights, same seed: same score, a tie keeps step 10
    assert second["eval/average"] == first["eval/average"] and second["eval/is_best"] == 0.0
    assert ev.best_step == 10
    report = json.loads((tmp_path / "eval_step20.json").read_text())
    assert report["step"] == 20 and report["benchmarks"]["sums"]["k"] == 4

    resumed = PeriodicEvaluator({}, every_n_steps=10)
    resumed.load_state_dict(json.loads(json.dumps(ev.state_dict())))  # survives a JSON round trip
    assert (resumed.best_step, resumed.best_score, resumed.history) == (ev.best_step, ev.best_score, ev.history)


def test_periodic_evaluator_loads_files_at_construction(tmp_path):
    with pytest.raises(FileNotFoundError):
        PeriodicEvaluator({"missing": str(tmp_path / "nope.jsonl")}, every_n_steps=1)


def test_resolve_model_dir(model_dir, tmp_path):
    assert resolve_model_dir(model_dir) == model_dir
    ckpt = tmp_path / "ckpt" / "step_100"
    shutil.copytree(model_dir, ckpt / "hf")
    assert resolve_model_dir(str(ckpt)) == str(ckpt / "hf")
    with pytest.raises(FileNotFoundError):
        resolve_model_dir(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="torch_dist"):
        with model_directory(str(tmp_path)):
            pass


def test_cli(model_dir, tmp_path, capsys):
    out = tmp_path / "report.json"
    rc = main(["--model", model_dir, "--bench", os.path.join(EXAMPLES, "arithmetic.jsonl"),
               "--bench", f"mc={os.path.join(EXAMPLES, 'multiple_choice.jsonl')}",
               "--k", "2", "--k-for", "arithmetic=3", "--max-new-tokens", "2", "--template", "raw",
               "--reward", "arithmetic", "--seed", "1", "--out", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "arithmetic" in table and "mc" in table and "average avg@k" in table
    report = json.loads(out.read_text())  # strict JSON
    assert report["benchmarks"]["arithmetic"]["k"] == 3 and report["benchmarks"]["mc"]["k"] == 2
    assert report["benchmarks"]["arithmetic"]["num_prompts"] == 3
    assert report["sampling"]["max_new_tokens"] == 2 and report["model"] == os.path.abspath(model_dir)


def test_cli_on_a_megatron_checkpoint(model_dir, tmp_path):
    """A step directory with a torch_dist actor/ is converted to HF and scores like the HF model."""
    from megatron_s3ac.convert import hf_to_mcore

    hf_to_mcore(model_dir, str(tmp_path / "checkpoints" / "step_000001" / "actor"), progress=False)
    args = ["--bench", os.path.join(EXAMPLES, "arithmetic.jsonl"), "--k", "4", "--max-new-tokens", "1",
            "--template", "raw", "--reward", "arithmetic"]
    main(["--model", str(tmp_path / "checkpoints" / "step_000001"), "--out", str(tmp_path / "ckpt.json"),
          "--convert-dir", str(tmp_path / "converted"), *args])
    main(["--model", model_dir, "--out", str(tmp_path / "hf.json"), *args])
    assert os.path.isfile(tmp_path / "converted" / "config.json")
    from_ckpt, from_hf = (json.loads((tmp_path / f).read_text()) for f in ("ckpt.json", "hf.json"))
    for key in ("avg_at_k", "pass_at_k", "mean_response_tokens"):
        assert from_ckpt["benchmarks"]["arithmetic"][key] == from_hf["benchmarks"]["arithmetic"][key]


def test_cli_rejects_unknown_k_for(model_dir, tmp_path):
    with pytest.raises(SystemExit, match="no --bench"):
        main(["--model", model_dir, "--bench", f"a={EXAMPLES}/arithmetic.jsonl", "--k-for", "b=2",
              "--out", str(tmp_path / "r.json")])
