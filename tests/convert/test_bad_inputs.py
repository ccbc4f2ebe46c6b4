"""Bad inputs: a clear error naming the cause, exit status 2, and no output (nor temp dir) left."""
import importlib
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints_convert import main
from megatron_s3ac.convert import ConversionError, hf_to_mcore

hf_to_mcore_mod = importlib.import_module("megatron_s3ac.convert.hf_to_mcore")  # the module, not the function


def copy_hf(src, dst, edit=None):
    shutil.copytree(src, dst)
    if edit:
        path = os.path.join(dst, "model.safetensors")
        sd = load_file(path)
        edit(sd)
        save_file(sd, path, metadata={"format": "pt"})
    return dst


def run_fails(capsys, args, out, *needles):
    assert main(args) == 2
    err = capsys.readouterr().err
    for n in needles:
        assert n in err, err
    parent = os.path.dirname(out)
    assert not any(f.startswith(f".{os.path.basename(out)}.partial") for f in os.listdir(parent))
    return err


def test_missing_tensor(hf_dirs, tmp_path, capsys):
    hf = copy_hf(hf_dirs["qwen3_moe"], tmp_path / "hf", lambda sd: sd.pop("model.layers.2.mlp.experts.3.up_proj.weight"))
    out = str(tmp_path / "out")
    run_fails(capsys, ["hf-to-mcore", "--hf", str(hf), "--out", out], out,
              "missing tensor model.layers.2.mlp.experts.3.up_proj.weight")
    assert not os.path.exists(out)


def test_wrong_shape(hf_dirs, tmp_path, capsys):
    def edit(sd):
        sd["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    hf = copy_hf(hf_dirs["qwen3"], tmp_path / "hf", edit)
    out = str(tmp_path / "out")
    run_fails(capsys, ["hf-to-mcore", "--hf", str(hf), "--out", out], out,
              "model.layers.1.self_attn.k_proj.weight has shape [16, 64], expected [32, 64]")
    assert not os.path.exists(out)


def test_unknown_tensor_is_not_dropped_silently(hf_dirs, tmp_path, capsys):
    hf = copy_hf(hf_dirs["qwen3"], tmp_path / "hf", lambda sd: sd.update({"model.extra.weight": torch.zeros(2)}))
    out = str(tmp_path / "out")
    run_fails(capsys, ["hf-to-mcore", "--hf", str(hf), "--out", out], out, "model.extra.weight")
    assert not os.path.exists(out)


def test_unsupported_model_type(hf_dirs, tmp_path, capsys):
    hf = copy_hf(hf_dirs["qwen3"], tmp_path / "hf")
    cfg = json.load(open(hf / "config.json"))
    cfg["model_type"] = "llama"
    json.dump(cfg, open(hf / "config.json", "w"))
    out = str(tmp_path / "out")
    run_fails(capsys, ["hf-to-mcore", "--hf", str(hf), "--out", out], out, "unsupported model_type 'llama'")
    assert not os.path.exists(out)


def test_corrupted_safetensors_header(hf_dirs, tmp_path, capsys):
    hf = copy_hf(hf_dirs["qwen3"], tmp_path / "hf")
    path = hf / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[8:20] = b"#garbage####"  # the JSON header starts at byte 8
    path.write_bytes(bytes(raw))
    out = str(tmp_path / "out")
    run_fails(capsys, ["hf-to-mcore", "--hf", str(hf), "--out", out], out,
              "corrupted safetensors header", "model.safetensors")
    assert not os.path.exists(out)


def test_output_dir_exists(hf_dirs, mcore_dirs, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    run_fails(capsys, ["hf-to-mcore", "--hf", hf_dirs["qwen3"], "--out", str(out)], str(out), "already exists")
    run_fails(capsys, ["mcore-to-hf", "--mcore", mcore_dirs["qwen3"], "--out", str(out)], str(out), "already exists")
    assert os.listdir(out) == ["keep.txt"]


def test_mcore_config_disagrees_with_hf_config(hf_dirs, mcore_dirs, tmp_path, capsys):
    out = str(tmp_path / "out")
    # a converted checkpoint records its config: a different --hf-config is refused by name
    run_fails(capsys, ["mcore-to-hf", "--mcore", mcore_dirs["qwen3"], "--out", out, "--hf-config",
                       hf_dirs["qwen2_untied"]], out, "disagrees with --hf-config", "model_type")
    # same model_type, other sizes
    cfg = json.load(open(os.path.join(hf_dirs["qwen3"], "config.json")))
    cfg["intermediate_size"] = 256
    other = tmp_path / "cfg"
    other.mkdir()
    json.dump(cfg, open(other / "config.json", "w"))
    run_fails(capsys, ["mcore-to-hf", "--mcore", mcore_dirs["qwen3"], "--out", out, "--hf-config", str(other)],
              out, "ffn_hidden_size")
    # a checkpoint without our metadata (like a training save): shapes are checked against the config
    bare = tmp_path / "bare"
    shutil.copytree(mcore_dirs["qwen3"], bare)
    os.remove(bare / "s3ac_convert.json")
    run_fails(capsys, ["mcore-to-hf", "--mcore", str(bare), "--out", out], out, "--hf-config")
    run_fails(capsys, ["mcore-to-hf", "--mcore", str(bare), "--out", out, "--hf-config", str(other)], out,
              "decoder.layers.mlp.linear_fc1.weight has global shape [4, 256, 64], the config implies [4, 512, 64]")
    assert not os.path.exists(out)


def test_failure_while_writing_leaves_nothing(hf_dirs, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = hf_to_mcore_mod.chunk_segments

    def flaky(*a):
        calls["n"] += 1
        if calls["n"] == 10:
            raise OSError("disk full (simulated)")
        return real(*a)

    monkeypatch.setattr(hf_to_mcore_mod, "chunk_segments", flaky)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="disk full"):
        hf_to_mcore(hf_dirs["qwen3_moe"], str(out), workers=2, progress=False)
    assert os.listdir(tmp_path) == []


def test_conversion_error_is_value_error():
    assert issubclass(ConversionError, ValueError)
