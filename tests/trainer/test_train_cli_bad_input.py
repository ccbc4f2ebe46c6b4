"""s3ac-train on bad input, as a new user would try it (issue 41): each case exits 2 with a line naming the file (and
the row / key), no traceback, and leaves train.out_dir absent. All fail before any process group, so ``main`` runs
in-process. Before, an empty / broken / wrongly typed prompt or coverage file, an HF config of the wrong shape or a
checkpoint cut short passed the CLI, which wrote <out_dir>/config.yaml and died later inside the Trainer."""
import json
import os
import re
import shutil

import pytest

from megatron_s3ac.trainer.cli import main

ROW = json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n"
COV = json.dumps({"prompt_ids": [3, 4], "response_ids": [5], "reward": 1}) + "\n"
SMALL = ["rollout.k=2", "rollout.prompts_per_step=2", "algo.actor_minibatches=1", "algo.critic_minibatches=1"]


@pytest.fixture(scope="module")
def char_model(tmp_path_factory):
    """A tiny HF model with the CPU demo's character tokenizer (WordLevel, no unknown token) + its torch_dist copy."""
    from megatron_s3ac.convert import hf_to_mcore
    from megatron_s3ac.models.tiny_models import save_tiny_hf
    from megatron_s3ac.data.char_tokenizer import save_char_tokenizer
    from megatron_s3ac.data.prompts import CharVocab

    d = tmp_path_factory.mktemp("char_model")
    vocab = CharVocab()
    save_tiny_hf("qwen3", str(d / "hf"), seed=0, vocab_size=vocab.size, eos_token_id=1, pad_token_id=0, bos_token_id=2)
    save_char_tokenizer(vocab, str(d / "hf"))
    hf_to_mcore(str(d / "hf"), str(d / "mcore"), progress=False)
    return d


def _w(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


def _cut(src, dst, suffix):
    """A copy of checkpoint dir ``src`` whose largest ``suffix`` file is cut in half; (dir, that file's name)."""
    shutil.copytree(src, dst)
    name = max((f for f in os.listdir(dst) if f.endswith(suffix)), key=lambda f: os.path.getsize(os.path.join(dst, f)))
    data = open(os.path.join(dst, name), "rb").read()
    open(os.path.join(dst, name), "wb").write(data[:len(data) // 2])
    return str(dst), name


def _math(m, path):
    return ["data.task=math", "model.tiny=null", f"model.hf_config={m}/hf", f"data.path={path}",
            "data.apply_chat_template=false"] + SMALL


# case -> (argv after the subcommand, given tmp_path and the model dir) and the message regex (same placeholders)
CASES = {
    "config_missing": (lambda t, m: ["train", f"{t}/nope.yaml"], r"config file not found: {t}/nope\.yaml"),
    "config_empty": (lambda t, m: ["train", _w(t, "e.yaml", "")], r"{t}/e\.yaml: a config is a mapping .*got nothing"),
    "config_not_yaml": (lambda t, m: ["train", _w(t, "b.yaml", "model: [\n")], r"{t}/b\.yaml: not YAML \("),
    "config_undecodable": (lambda t, m: ["train", _w(t, "u.yaml", "") and (t / "u.yaml").write_bytes(b"\xff\xfe:")
                                         and str(t / "u.yaml")], r"{t}/u\.yaml: not YAML \("),
    "config_list": (lambda t, m: ["train", _w(t, "l.yaml", "- a\n- b\n")], r"{t}/l\.yaml: a config is a mapping.*a list"),
    "config_k_abc": (lambda t, m: ["check", _w(t, "k.yaml", "model: {tiny: arithmetic_moe}\nrollout: {k: abc}\n")],
                     r"{t}/k\.yaml: rollout\.k: Value 'abc' of type 'str' could not be converted to Integer$"),
    "config_steps_x": (lambda t, m: ["demo", _w(t, "s.yaml", "model: {tiny: arithmetic_moe}\n"), "train.steps=x"],
                       r"command-line override: train\.steps: Value 'x' .* to Integer$"),
    "config_unknown_key": (lambda t, m: ["pipeline", _w(t, "u.yaml", "train: {stepz: 3}\n")],
                           r"{t}/u\.yaml: train\.stepz: Key 'stepz' not in 'TrainCfg'\. Did you mean: 'steps'\?$"),
    "data_empty": (lambda t, m: ["train"] + _math(m, _w(t, "e.jsonl", "")),
                   r"data\.path: {t}/e\.jsonl: no usable prompt in 0 row\(s\)"),
    "data_not_json": (lambda t, m: ["train"] + _math(m, _w(t, "n.jsonl", ROW.replace("}", ""))),
                      r"data\.path: {t}/n\.jsonl: no usable prompt in 1 row\(s\) \(1 malformed.*row 0 is not JSON"),
    "data_wrong_types": (lambda t, m: ["check"] + _math(m, _w(t, "w.jsonl", json.dumps({"prompt": ["x"], "answer": {}}))),
                         r"data\.path: {t}/w\.jsonl: no usable prompt in 1 row\(s\) \(1 malformed.*row 0 has no prompt"),
    "data_unencodable": (lambda t, m: ["train"] + _math(m, _w(t, "u.jsonl", ROW + ROW.replace("1+1=", "what is 1+1?"))),
                         r"data\.path: {t}/u\.jsonl row 1: the tokenizer cannot encode the prompt 'what is 1\+1\?'"),
    # issue 37: a critic that reads the reference refuses a file whose rows carry none (or no solution), naming it
    "privileged_no_reference": (lambda t, m: ["check", "algo.name=s3ac", "model.critic_privileged=answer"]
                                + _math(m, _w(t, "r.jsonl", 2 * (json.dumps({"prompt": "1+1="}) + "\n"))),
                                r"data\.path: {t}/r\.jsonl: model\.critic_privileged=answer needs each row's "
                                r"reference answer, and 2 of its 2 rows carry none"),
    "privileged_no_solution": (lambda t, m: ["check", "algo.name=s3ac", "model.critic_privileged=answer_and_solution"]
                               + _math(m, _w(t, "s.jsonl", ROW)),
                               r"data\.path: {t}/s\.jsonl: model\.critic_privileged=answer_and_solution needs a "
                               r"solution column, and none of its 1 usable rows carries one"),
    "coverage_unset": (lambda t, m: ["value-pretrain", "model.tiny=arithmetic_moe"] + SMALL,
                       r"value_pretrain\.coverage_path: value-pretrain needs it"),
    "coverage_missing": (lambda t, m: ["value-pretrain", "model.tiny=arithmetic_moe",
                                       f"value_pretrain.coverage_path={t}/no.jsonl"] + SMALL,
                         r"value_pretrain\.coverage_path='{t}/no\.jsonl' does not exist"),
    "coverage_empty": (lambda t, m: ["value-pretrain", "model.tiny=arithmetic_moe",
                                     f"value_pretrain.coverage_path={_w(t, 'c.jsonl', '')}"] + SMALL,
                       r"value_pretrain\.coverage_path: {t}/c\.jsonl: no usable coverage row \(0 malformed\)"),
    "coverage_broken_row": (lambda t, m: ["value-pretrain", "model.tiny=arithmetic_moe",
                                          f"value_pretrain.coverage_path={_w(t, 'c.jsonl', COV[:20])}"] + SMALL,
                            r"{t}/c\.jsonl: no usable coverage row \(1 malformed; line 1: not JSON"),
    "coverage_wrong_types": (lambda t, m: ["value-pretrain", "model.tiny=arithmetic_moe", "value_pretrain.coverage_path="
                                           + _w(t, "c.jsonl", COV.replace("[3, 4]", '"34"') + COV.replace("1}", '"1"}'))]
                             + SMALL, r"{t}/c\.jsonl: no usable coverage row \(2 malformed; line 1: prompt_ids must be "
                                      r"a non-empty list of token ids, got \"34\""),
    "hf_config_empty": (lambda t, m: ["train", "model.tiny=null", f"model.hf_config={_w(t, 'config.json', '')}"] + SMALL,
                        r"model\.hf_config: {t}/config\.json: not a JSON config"),
    "hf_config_wrong_types": (lambda t, m: ["train", "model.tiny=null", "model.hf_config=" + _w(t, "c.json", json.dumps(
        {**json.load(open(f"{m}/hf/config.json")), "hidden_size": "64"}))] + SMALL,
        r"model\.hf_config: {t}/c\.json: hidden_size must be a positive integer, got '64'"),
    "hf_config_unsupported": (lambda t, m: ["check", "model.tiny=null", "model.hf_config="
                                            + _w(t, "c.json", json.dumps({"model_type": "bert"}))] + SMALL,
                              r"model\.hf_config: {t}/c\.json: unsupported model_type 'bert'"),
    "hf_weights_truncated": (lambda t, m: ["train", "model.tiny=null", f"model.hf_config={_cut(f'{m}/hf', t / 'cut', '.safetensors')[0]}"]
                             + SMALL, r"model\.hf_config: corrupted safetensors header in {t}/cut/model\.safetensors"),
    "actor_init_not_a_checkpoint": (lambda t, m: ["train", "model.tiny=arithmetic_moe", f"model.actor_init={m}/hf"] + SMALL,
                                    r"model\.actor_init: {m}/hf/metadata\.json: missing or not JSON"),
    "actor_init_truncated": (lambda t, m: ["train", "model.tiny=arithmetic_moe",
                                           f"model.actor_init={_cut(f'{m}/mcore', t / 'cut', '.distcp')[0]}"] + SMALL,
                             r"model\.actor_init: {t}/cut/__0_0\.distcp: \d+ bytes, \.metadata places data up to byte"),
    "critic_init_metadata_truncated": (lambda t, m: ["train", "model.tiny=arithmetic_moe",
                                                     f"model.critic_init={_cut(f'{m}/mcore', t / 'cut', '.metadata')[0]}"]
                                       + SMALL, r"model\.critic_init: {t}/cut/\.metadata: unreadable"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_exits_2_naming_it_and_writes_nothing(case, tmp_path, char_model, capsys):
    argv, match = CASES[case]
    out = tmp_path / "run"
    rc = main(argv(tmp_path, char_model) + [f"train.out_dir={out}"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert re.search(match.format(t=re.escape(str(tmp_path)), m=re.escape(str(char_model))), line), err
    assert not out.exists()  # no run dir, no config.yaml


def test_good_math_inputs_pass_the_check(tmp_path, char_model, capsys):
    """The reference for the cases above: the same model and a usable prompt file pass (a row the tokenizer cannot
    encode, or a broken row next to good ones, is what the check is about, not the files' kind)."""
    data = _w(tmp_path, "ok.jsonl", ROW + "{broken\n")
    assert main(["check"] + _math(char_model, data)) == 0, capsys.readouterr().err
