"""s3ac-eval on bad input, as a new user would try it (issue 41): each case exits 2 with one line naming the file
(and the row), and writes no report. Before, a file whose only row was broken JSON printed a table of "n/a",
wrote eval_report.json and exited 0, and a row the tokenizer could not encode died in a raw tokenizers traceback."""
import json
import os

import pytest

from megatron_s3ac.eval.cli import main


def _case(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


CASES = {
    "broken_json": ("b.jsonl", '{"prompt": "1+1=", "answer": \n', r"b\.jsonl: benchmark 'x' has no usable row "
                    r"\(0 parsed; skipped: bad_json 1; line 1 is not JSON"),
    "empty": ("e.jsonl", "", r"e\.jsonl: benchmark 'x' has no usable row \(0 parsed\)"),
    "wrong_types": ("w.jsonl", json.dumps({"prompt": ["not", "text"], "answer": {"a": 1}}) + "\n",
                    r"w\.jsonl: benchmark 'x' has no usable row \(1 parsed; skipped: "),
    "not_a_list": ("n.json", json.dumps({"prompt": "1+1="}), r"n\.json: a \.json benchmark must hold a list"),
    "not_json": ("j.json", "[{]", r"j\.json: not JSON \(Expecting property name"),
    "unencodable": ("u.jsonl", json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n"
                    + json.dumps({"prompt": "what is 1+1?", "answer": "2"}) + "\n",
                    r"u\.jsonl: item 1 of x: the tokenizer cannot encode the prompt 'what is 1\+1\?'"),
}


@pytest.fixture(scope="module")
def demo_like_dir(tmp_path_factory):
    """A tiny model with the CPU demo's tokenizer (WordLevel over its characters, no unknown token)."""
    from megatron_s3ac.models.tiny_models import save_tiny_hf
    from megatron_s3ac.data.char_tokenizer import save_char_tokenizer
    from megatron_s3ac.data.prompts import CharVocab

    d = str(tmp_path_factory.mktemp("demo_like"))
    vocab = CharVocab()
    save_tiny_hf("qwen3", d, seed=0, vocab_size=vocab.size, eos_token_id=1, pad_token_id=0, bos_token_id=2)
    return save_char_tokenizer(vocab, d)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_benchmark_file_exits_2_naming_it_and_writes_nothing(case, tmp_path, demo_like_dir, capsys):
    model_dir = demo_like_dir
    fname, text, match = CASES[case]
    path = _case(tmp_path, fname, text)
    out = tmp_path / "report.json"
    try:
        rc = main(["--model", model_dir, "--bench", f"x={path}", "--k", "1", "--max-new-tokens", "2",
                   "--template", "raw", "--out", str(out)])
    except SystemExit as e:  # argparse-level refusals exit too; the message is then the exception's
        rc, err = e.code, str(e)
    else:
        err = capsys.readouterr().err
    assert rc not in (0, None), err
    import re

    assert re.search(match, err), err
    assert "Traceback" not in err
    assert not out.exists() and not os.path.exists(str(out) + ".tmp")


def test_missing_and_truncated_checkpoint(tmp_path, model_dir, capsys):
    bench = _case(tmp_path, "ok.jsonl", json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    out = tmp_path / "report.json"
    rc = main(["--model", str(tmp_path / "nowhere"), "--bench", f"x={bench}", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "nowhere" in err and not out.exists(), err
    # a checkpoint whose weights file is cut in half
    import shutil

    cut = tmp_path / "cut"
    shutil.copytree(model_dir, cut)
    st = next(p for p in os.listdir(cut) if p.endswith(".safetensors"))
    data = (cut / st).read_bytes()
    (cut / st).write_bytes(data[:len(data) // 2])
    rc = main(["--model", str(cut), "--bench", f"x={bench}", "--max-new-tokens", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and st in err and not out.exists(), err
