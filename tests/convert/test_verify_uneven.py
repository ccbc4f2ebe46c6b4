"""`s3ac-convert verify --pp 2` on a 3-layer Qwen3-MoE: the layers do not split evenly over 2 stages,
so the layout is split automatically (2 | 1, ParallelLayout.resolve) and megatron's logits must still
equal transformers'. A --pp larger than the layer count is refused with a clear error."""
import pytest

from checkpoints_convert import main
from megatron_s3ac.convert import hf_to_mcore
from megatron_s3ac.models.tiny_models import save_tiny_hf


@pytest.fixture(scope="module")
def three_layer(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe3")
    hf = save_tiny_hf("qwen3_moe", str(root / "hf"), seed=4, num_hidden_layers=3)
    mc = str(root / "mcore")
    hf_to_mcore(hf, mc, progress=False)
    return hf, mc


def test_verify_pp2_three_layers(three_layer, tmp_path, capsys):
    import torch

    hf, mc = three_layer
    dump = str(tmp_path / "logits.pt")
    assert main(["verify", "--hf", hf, "--mcore", mc, "--pp", "2", "--dump-logits", dump]) == 0
    assert "max abs logit diff" in capsys.readouterr().out
    d = torch.load(dump, weights_only=True)
    assert d["hf"].shape == d["mcore"].shape == (2, 16, 96)
    assert (d["hf"] - d["mcore"]).abs().max() < 1e-4


def test_verify_refuses_empty_stage(three_layer, capsys):
    hf, mc = three_layer
    assert main(["verify", "--hf", hf, "--mcore", mc, "--pp", "4"]) != 0
    assert "fewer than pp=4" in capsys.readouterr().err
