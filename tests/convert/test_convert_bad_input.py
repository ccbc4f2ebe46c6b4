"""s3ac-convert on bad input, as a new user would try it (issue 41): every case exits 2 with one line naming the
file (and the key or tensor), no traceback, and no --out directory (nor a hidden .partial sibling) left behind.
Before, a config.json that was empty / not JSON / had "hidden_size": "64", a truncated torch_dist checkpoint
(.distcp or .metadata), a broken s3ac_convert.json or index, and verify on a truncated or missing checkpoint
all died in raw tracebacks (JSONDecodeError, TypeError, BadZipFile, UnpicklingError, SafetensorError, ...)."""
import json
import os
import shutil

import pytest

from checkpoints_convert import main


def _copy(src, dst, config=None, edit=None):
    """A copy of the checkpoint dir ``src``; ``config``: new config.json text or bytes, ``edit``: fn(config dict)."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    if config is not None:
        with open(path, "wb") as f:
            f.write(config.encode() if isinstance(config, str) else config)
    if edit is not None:
        cfg = json.load(open(path))
        edit(cfg)
        json.dump(cfg, open(path, "w"))
    return str(dst)


def _cut(path):
    """Keep the first half of the file, as an interrupted copy or download leaves it."""
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])


def _hf_cut(t, hf, mc):
    d = _copy(hf, t / "cut")
    _cut(os.path.join(d, "model.safetensors"))
    return d


def _hf_index(t, hf, mc):
    d = _copy(hf, t / "idx")
    open(os.path.join(d, "model.safetensors.index.json"), "w").write('{"weight_map": ')
    return d


def _hf_missing_tensor(t, hf, mc):
    from safetensors.torch import load_file, save_file

    d = _copy(hf, t / "mt")
    path = os.path.join(d, "model.safetensors")
    sd = load_file(path)
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, path, metadata={"format": "pt"})
    return d


def _mc_copy(t, mc, name="mc"):
    d = t / name
    shutil.copytree(mc, d)
    return d


def _mc_cut_distcp(t, hf, mc):
    d = _mc_copy(t, mc)
    for f in os.listdir(d):
        if f.endswith(".distcp"):
            _cut(d / f)
    return str(d)


def _mc_cut_metadata(t, hf, mc):
    d = _mc_copy(t, mc)
    _cut(d / ".metadata")
    return str(d)


def _mc_no_distcp(t, hf, mc):
    d = _mc_copy(t, mc)
    os.remove(d / "__0_0.distcp")
    return str(d)


def _mc_bad_meta_json(t, hf, mc):
    d = _mc_copy(t, mc)
    (d / "s3ac_convert.json").write_text("{")
    return str(d)


def _mc_bare(t, mc):
    """A checkpoint without our s3ac_convert.json (like a training save): --hf-config is needed."""
    d = _mc_copy(t, mc, "bare")
    os.remove(d / "s3ac_convert.json")
    return str(d)


def _empty(t, hf, mc):
    os.makedirs(t / "empty")
    return str(t / "empty")


def H(make, *needles):
    """hf-to-mcore --hf make(tmp, hf, mcore)."""
    return lambda t, hf, mc: (["hf-to-mcore", "--hf", make(t, hf, mc)], needles)


def M(make, *needles, hf_config=None):
    """mcore-to-hf --mcore make(tmp, hf, mcore) [--hf-config hf_config(tmp, hf)]."""
    def build(t, hf, mc):
        extra = ["--hf-config", hf_config(t, hf)] if hf_config else []
        return ["mcore-to-hf", "--mcore", make(t, hf, mc), *extra], needles
    return build


def V(hf_make, mc_make, *needles):
    """verify --hf hf_make(...) --mcore mc_make(...)."""
    return lambda t, hf, mc: (["verify", "--hf", hf_make(t, hf, mc), "--mcore", mc_make(t, hf, mc)], needles)


def _hf(t, hf, mc):
    return hf


def _mc(t, hf, mc):
    return mc


CASES = {
    "hf_missing": H(lambda t, hf, mc: str(t / "nowhere"), "nowhere"),
    "hf_empty_dir": H(_empty, "empty/config.json"),
    "config_empty": H(lambda t, hf, mc: _copy(hf, t / "h", config=""), "h/config.json: not a JSON config"),
    "config_not_json": H(lambda t, hf, mc: _copy(hf, t / "h", config="{model_type: qwen3"),
                         "h/config.json: not a JSON config"),
    "config_list": H(lambda t, hf, mc: _copy(hf, t / "h", config='["qwen3"]'),
                     "h/config.json: the config must be a JSON object, got a list"),
    "config_not_utf8": H(lambda t, hf, mc: _copy(hf, t / "h", config=b'{"model_type": "qw\xe9n3"}'),
                         "h/config.json: not a JSON config ('utf-8' codec can't decode"),
    "config_no_model_type": H(lambda t, hf, mc: _copy(hf, t / "h", edit=lambda c: c.pop("model_type")),
                              "h/config.json: the config has no model_type"),
    "config_unsupported_arch": H(lambda t, hf, mc: _copy(hf, t / "h", edit=lambda c: c.update(model_type="llama")),
                                 "h/config.json: unsupported model_type 'llama'"),
    "config_size_is_string": H(lambda t, hf, mc: _copy(hf, t / "h", edit=lambda c: c.update(hidden_size="64")),
                               "h/config.json: hidden_size must be a positive integer, got '64' (str)"),
    # bool("false") is True: read as is, this would convert an untied model as a tied one
    "config_flag_is_string": H(lambda t, hf, mc: _copy(hf, t / "h", edit=lambda c: c.update(
        tie_word_embeddings="false")), "h/config.json: tie_word_embeddings must be true or false, got 'false'"),
    "config_key_missing": H(lambda t, hf, mc: _copy(hf, t / "h", edit=lambda c: c.pop("num_hidden_layers")),
                            "h/config.json: the qwen3 config has no num_hidden_layers"),
    "safetensors_truncated": H(_hf_cut, "cut/model.safetensors", "truncated"),
    "safetensors_missing_tensor": H(_hf_missing_tensor, "missing tensor model.layers.1.mlp.up_proj.weight", "/mt"),
    "index_not_json": H(_hf_index, "idx/model.safetensors.index.json: not JSON"),
    "mcore_missing": M(lambda t, hf, mc: str(t / "nowhere"), "nowhere is not a torch_dist checkpoint"),
    "mcore_empty_dir": M(_empty, "empty is not a torch_dist checkpoint"),
    "distcp_truncated": M(_mc_cut_distcp, "mc/__0_0.distcp has ", "the checkpoint is truncated"),
    "distcp_missing": M(_mc_no_distcp, "mc/__0_0.distcp is missing"),
    "metadata_truncated": M(_mc_cut_metadata, "mc/.metadata: not a readable torch_dist metadata file"),
    "s3ac_convert_json_broken": M(_mc_bad_meta_json, "mc/s3ac_convert.json: not JSON"),
    "hf_config_missing": M(lambda t, hf, mc: _mc_bare(t, mc), "nowhere", hf_config=lambda t, hf: str(t / "nowhere")),
    "hf_config_not_json": M(lambda t, hf, mc: _mc_bare(t, mc), "h/config.json: not a JSON config",
                            hf_config=lambda t, hf: _copy(hf, t / "h", config="{")),
    "hf_config_wrong_type": M(lambda t, hf, mc: _mc_bare(t, mc), "h/config.json: num_attention_heads must be",
                              hf_config=lambda t, hf: _copy(hf, t / "h", edit=lambda c: c.update(
                                  num_attention_heads=4.0))),
    "verify_hf_truncated": V(_hf_cut, _mc, "cut/model.safetensors", "truncated"),
    "verify_mcore_truncated": V(_hf, _mc_cut_distcp, "mc/__0_0.distcp has "),
    "verify_mcore_missing": V(_hf, lambda t, hf, mc: str(t / "nowhere"), "nowhere is not a torch_dist checkpoint"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_exits_2_naming_the_file_and_leaves_no_output(case, hf_dirs, mcore_dirs, tmp_path, capsys):
    inputs = tmp_path / "in"
    inputs.mkdir()
    argv, needles = CASES[case](inputs, hf_dirs["qwen3"], mcore_dirs["qwen3"])
    outputs = tmp_path / "out"
    outputs.mkdir()
    out = outputs / "result"
    argv += ["--dump-logits", str(out)] if argv[0] == "verify" else ["--out", str(out), "--no-progress"]
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"s3ac-convert {argv[0]}: error: "), err
    for n in needles:
        assert n in err, (n, err)
    assert os.listdir(outputs) == []  # neither --out nor a hidden .result.partial-* sibling


def test_existing_out_is_refused_and_kept(hf_dirs, mcore_dirs, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    for argv in (["hf-to-mcore", "--hf", hf_dirs["qwen3"]], ["mcore-to-hf", "--mcore", mcore_dirs["qwen3"]]):
        assert main([*argv, "--out", str(out), "--no-progress"]) == 2
        assert f"output directory {out} already exists" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(out) == ["mine.txt"]
