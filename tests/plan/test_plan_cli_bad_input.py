"""s3ac-plan on bad input, as a new user would try it (issue 41): each case exits 2 with one line naming the file (and
key) or the flag, no traceback and nothing on stdout. Before, an HF config with a non-integer or zero size died in a
TypeError / ZeroDivisionError traceback, an undecodable one in a UnicodeDecodeError, and --tp 0, --top 0 and a nan
or inf memory size were planned as if they made sense."""
import json
import os
import re

import pytest

from megatron_s3ac.plan import cli

Q15 = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "hf_configs", "qwen2_5_math_1_5b")
GOOD = json.load(open(os.path.join(Q15, "config.json")))


def _w(t, name, data):
    (t / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    return str(t / name)


def _hf(t, name, data):
    return [_w(t, name, data), "--gpus", "8"]


def _cfg(t, text):
    return ["--config", _w(t, "t.yaml", text), "--gpus", "8"]


CASES = {
    "hf_missing": (lambda t: [f"{t}/nope", "--gpus", "8"], r"no HF config at {t}/nope$"),
    "hf_empty": (lambda t: _hf(t, "e.json", ""), r"{t}/e\.json: not a JSON config \(Expecting value"),
    "hf_not_json": (lambda t: _hf(t, "n.json", "{model_type: qwen2"), r"{t}/n\.json: not a JSON config"),
    "hf_undecodable": (lambda t: _hf(t, "u.json", b"\xff\xfe{"), r"{t}/u\.json: not a JSON config \('utf-8'"),
    "hf_not_an_object": (lambda t: _hf(t, "l.json", "[1, 2]"), r"{t}/l\.json: the config must be a JSON object, got a list"),
    "hf_model_type_not_a_string": (lambda t: _hf(t, "m.json", json.dumps({"model_type": ["qwen2"]})),
                                   r"{t}/m\.json: model_type must be a string"),
    "hf_size_a_string": (lambda t: _hf(t, "s.json", json.dumps({**GOOD, "hidden_size": "big"})),
                         r"{t}/s\.json: hidden_size must be a positive integer, got 'big'"),
    "hf_size_a_float": (lambda t: _hf(t, "f.json", json.dumps({**GOOD, "num_hidden_layers": 2.5})),
                        r"{t}/f\.json: num_hidden_layers must be a positive integer, got 2\.5"),
    "hf_zero_heads": (lambda t: _hf(t, "z.json", json.dumps({**GOOD, "num_attention_heads": 0})),
                      r"{t}/z\.json: num_attention_heads must be a positive integer, got 0"),
    "hf_unsupported": (lambda t: _hf(t, "b.json", json.dumps({"model_type": "bert"})),
                       r"{t}/b\.json: unsupported model_type 'bert'; supported: qwen2"),
    "config_missing": (lambda t: ["--config", f"{t}/no.yaml", "--gpus", "8"], r"--config {t}/no\.yaml: no such file"),
    "config_empty": (lambda t: _cfg(t, ""), r"{t}/t\.yaml: a config is a mapping .*got nothing"),
    "config_not_yaml": (lambda t: _cfg(t, "model: [\n"), r"{t}/t\.yaml: not YAML \("),
    "config_wrong_type": (lambda t: _cfg(t, "model: {tiny: arithmetic_moe}\nrollout: {k: abc}\n"),
                          r"{t}/t\.yaml: rollout\.k: Value 'abc' of type 'str' could not be converted to Integer$"),
    "config_unknown_key": (lambda t: _cfg(t, "model: {tiny: arithmetic_moe}\nrollout: {kk: 2}\n"),
                           r"{t}/t\.yaml: rollout\.kk: Key 'kk' not in 'RolloutCfg'"),
    "config_bad_hf_config": (lambda t: _cfg(t, f"model: {{hf_config: {_w(t, 'c.json', '[]')}}}\n"),
                             r"{t}/c\.json: the config must be a JSON object"),
    "gpus_zero": (lambda t: [Q15, "--gpus", "0"], r"--gpus 0 \(or cluster\.gpus\)"),
    "gpus_negative": (lambda t: [Q15, "--gpus", "-8"], r"--gpus -8 \(or cluster\.gpus\)"),
    "gpus_per_node_zero": (lambda t: [Q15, "--gpus", "8", "--gpus-per-node", "0"], r"--gpus-per-node 0"),
    "gpu_mem_nan": (lambda t: [Q15, "--gpus", "8", "--gpu-mem-gib", "nan"], r"--gpu-mem-gib nan"),
    "host_mem_inf": (lambda t: [Q15, "--gpus", "8", "--host-mem-gib", "inf"], r"--host-mem-gib inf"),
    "tp_zero": (lambda t: [Q15, "--gpus", "8", "--tp", "0"], r"tp=0 must be >= 1"),
    "top_zero": (lambda t: [Q15, "--gpus", "8", "--top", "0"], r"--top 0 must be >= 1"),
    "k_zero": (lambda t: [Q15, "--gpus", "8", "--k", "0"], r"k=0 must be >= 1"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_exits_2_naming_it_without_stdout(case, tmp_path, capsys):
    argv, match = CASES[case]
    with pytest.raises(SystemExit) as e:
        cli.main(argv(tmp_path))
    cap = capsys.readouterr()
    assert e.value.code == 2, cap.err
    assert cap.out == "" and "Traceback" not in cap.err
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("s3ac-plan: error: "), cap.err
    assert re.search(match.format(t=re.escape(str(tmp_path))), lines[0]), cap.err


def test_the_good_config_plans(capsys):
    """The reference for the cases above: the unmodified HF config plans (exit 0, a table)."""
    with pytest.raises(SystemExit) as e:
        cli.main([Q15, "--gpus", "8", "--top", "1"])
    assert e.value.code == 0 and "best:" in capsys.readouterr().out
