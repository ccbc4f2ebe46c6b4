"""tools/build_coverage_data.py on bad input, as a new user would try it (issue 41): every case exits 2 with one
message naming the file (and the row or key), no traceback, and no --out file (nor its .tmp) left behind, before
any rollout. Before, an empty or non-JSON prompt file rolled nothing out and died in a RuntimeError leaving
cov.jsonl.tmp; a row the tokenizer could not encode, a non-UTF-8 or damaged prompt file, a checkpoint with a
truncated model.safetensors or a broken config.json died in raw tracebacks (the latter two leaving the .tmp)."""
import json
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

GOOD_ROWS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+3=", "answer": "5"}]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """A tiny model with the CPU demo's tokenizer (WordLevel over its characters, no unknown token)."""
    from megatron_s3ac.models.tiny_models import save_tiny_hf
    from megatron_s3ac.data.char_tokenizer import save_char_tokenizer
    from megatron_s3ac.data.prompts import CharVocab

    d = str(tmp_path_factory.mktemp("policy"))
    vocab = CharVocab()
    save_tiny_hf("qwen3", d, seed=0, vocab_size=vocab.size, eos_token_id=1, pad_token_id=0, bos_token_id=2)
    return save_char_tokenizer(vocab, d)


def _write(path, content):
    with open(path, "wb") as f:
        f.write(content.encode() if isinstance(content, str) else content)
    return str(path)


def _jsonl(rows):
    return "".join(json.dumps(r) + "\n" for r in rows)


def _config(t, policy, data=None, extra=""):
    """A math-task trainer config over ``data`` (a prompt file; default: two good rows)."""
    data = data or _write(t / "good.jsonl", _jsonl(GOOD_ROWS))
    return _write(t / "cfg.yaml", f"""model: {{hf_config: {policy}}}
data: {{task: math, path: {data}, apply_chat_template: false}}
rollout: {{prompts_per_step: 2, k: 2, max_new_tokens: 3, reward: math}}
algo: {{actor_minibatches: 1, critic_minibatches: 1}}
pipeline: {{coverage_prompts: 2, coverage_k: 2}}
{extra}""")


def _ckpt(t, policy, edit):
    d = t / "ck"
    shutil.copytree(policy, d)
    edit(d)
    return str(d)


def _cut_weights(d):
    path = d / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def C(text, *needles):
    """--config holding ``text``."""
    return lambda t, pol: (["--config", _write(t / "c.yaml", text), "--checkpoints", pol], ("c.yaml",) + needles)


def D(name, content, *needles):
    """A config whose data.path is the file ``name`` holding ``content``."""
    return lambda t, pol: (["--config", _config(t, pol, _write(t / name, content)), "--checkpoints", pol],
                           (name,) + needles)


def K(edit, *needles):
    """A good config, --checkpoints: the policy and a copy of it changed by ``edit(dir)``."""
    return lambda t, pol: (["--config", _config(t, pol), "--checkpoints", pol, _ckpt(t, pol, edit)], needles)


CASES = {
    "config_missing": lambda t, pol: (["--config", str(t / "nowhere.yaml"), "--checkpoints", pol],
                                      ("config file not found", "nowhere.yaml")),
    "config_empty": C("", "a config is a mapping of sections"),
    "config_not_yaml": C("model: {hf_config: [\n", "did not find expected node content"),
    "config_not_a_mapping": C("- model\n- data\n", "invalid config"),
    "config_wrong_type": lambda t, pol: (["--config", _config(t, pol, extra="train: {seed: abc}"), "--checkpoints",
                                          pol], ("cfg.yaml", "train.seed", "'abc'")),
    "data_empty": D("p.jsonl", "", "no usable prompt in 0 row(s)"),
    "data_not_json": D("p.jsonl", '{"prompt": "1+1=", "answer": \n', "no usable prompt in 1 row(s)",
                       "row 0 is not JSON"),
    "data_wrong_types": D("p.jsonl", _jsonl([{"prompt": ["1+1="], "answer": "2"},
                                             {"prompt": "1+1=", "answer": {"a": 2}}]),
                          "no usable prompt in 2 row(s) (2 malformed", "row 0 has no prompt text and answer"),
    "data_unencodable": D("p.jsonl", _jsonl(GOOD_ROWS + [{"prompt": "what is 1+1?", "answer": "2"}]),
                          "row 2: the tokenizer cannot encode the prompt 'what is 1+1?'"),
    "data_not_utf8": D("p.jsonl", b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "1+\xff=", "answer": "2"}\n',
                       "line 2: not UTF-8 text"),
    "data_not_parquet": D("p.parquet", "not parquet", "not a readable parquet file"),
    "data_is_a_directory": lambda t, pol: (["--config", _config(t, pol, str(t)), "--checkpoints", pol],
                                           (f"{t}: no such prompt file (a directory)",)),
    "checkpoint_missing": lambda t, pol: (["--config", _config(t, pol), "--checkpoints", pol, str(t / "nowhere")],
                                          ("nowhere does not exist",)),
    "checkpoint_empty_dir": K(lambda d: [os.remove(d / f) for f in os.listdir(d)], "ck has no config.json"),
    "checkpoint_truncated": K(_cut_weights, "ck/model.safetensors", "truncated"),
    "checkpoint_config_not_json": K(lambda d: (d / "config.json").write_text("{"), "ck/config.json: not a JSON config"),
    "checkpoint_no_weights": K(lambda d: os.remove(d / "model.safetensors"), "ck has no weights"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_exits_2_naming_the_file_and_writes_nothing(case, policy, tmp_path, capsys):
    import build_coverage_data

    inputs = tmp_path / "in"
    inputs.mkdir()
    argv, needles = CASES[case](inputs, policy)
    outputs = tmp_path / "out"
    outputs.mkdir()
    capsys.readouterr()
    rc = build_coverage_data.main([*argv, "--out", str(outputs / "cov.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("build_coverage_data: ") and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)
    assert os.listdir(outputs) == []  # neither cov.jsonl nor cov.jsonl.tmp


def test_a_failure_mid_run_leaves_no_partial_file(policy, tmp_path):
    """The first policy's rows are in cov.jsonl.tmp when the second one fails: the .tmp is removed too."""
    from megatron_s3ac.trainer.stages.coverage import CoverageSettings, generate_coverage
    from megatron_s3ac.data.prompts import Prompt

    calls = []

    def score(texts, refs):
        calls.append(len(texts))
        if len(calls) == 2:
            raise RuntimeError("reward worker died (simulated)")
        return [0.0] * len(texts)

    out = tmp_path / "cov.jsonl"
    with pytest.raises(RuntimeError, match="simulated"):
        generate_coverage([policy, policy], [Prompt([5, 6], "x", "2")], CoverageSettings(k=1, max_new_tokens=2),
                          decode=str, score=score, out_path=str(out))
    assert calls == [1, 1] and os.listdir(tmp_path) == []
