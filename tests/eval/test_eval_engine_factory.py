"""s3ac-eval builds its engine through the rollout factory (megatron_s3ac.rollout.factory), as training does."""
import pytest
import torch

from megatron_s3ac.eval import cli
from megatron_s3ac.eval.benchmarks import EvalInputError
from megatron_s3ac.rollout.base import SamplingParams
from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine


@pytest.mark.parametrize("kind", ["cpu", "hf"])
def test_factory_engine_samples_like_a_direct_cpu_engine(kind, model_dir, tokenizer, engine):
    """Same seeds, same tokens and log-probs as CPUEngine.from_pretrained (the engine s3ac-eval built
    before); hf without CUDA runs on the CPU. The eval tokenizer is the one that decodes."""
    built = cli.build_engine(kind, model_dir, tokenizer)
    assert isinstance(built, CPUEngine) and built.tokenizer is tokenizer
    assert built.device.type == ("cuda" if kind == "hf" and torch.cuda.is_available() else "cpu")
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)
    prompts = [tokenizer.encode("1+2="), tokenizer.encode("7*3=")]
    got = built.generate(prompts, params, n_samples=2)
    want = engine.generate(prompts, params, n_samples=2)
    for g, w in zip(sum(got, []), sum(want, [])):
        assert g.response_ids == w.response_ids
        torch.testing.assert_close(torch.as_tensor(g.logprobs), torch.as_tensor(w.logprobs))


def test_bf16_engine_weights(model_dir, tokenizer):
    built = cli.build_engine("cpu", model_dir, tokenizer, dtype="bf16")
    assert next(built.model.parameters()).dtype == torch.bfloat16


def test_sglang_refuses_a_directory_it_cannot_serve(tmp_path, tokenizer):
    with pytest.raises(EvalInputError, match="--engine: .*no config.json"):
        cli.build_engine("sglang", str(tmp_path), tokenizer)


def test_engine_flag_choices():
    base = ["--model", "m", "--bench", "b=x.jsonl"]
    assert cli.parse_args(base).engine == "cpu"
    assert cli.parse_args(base + ["--engine", "hf"]).engine == "hf"
    assert cli.parse_args(base + ["--engine", "vllm"]).engine == "vllm"  # a vLLM engine in its own environment
    with pytest.raises(SystemExit):
        cli.parse_args(base + ["--engine", "trtllm"])
