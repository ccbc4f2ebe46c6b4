"""s3ac-convert verify --cp N: megatron at context parallel vs transformers (fp32), on a sequence whose
length is not a multiple of 2 x cp (padded inside verify, the real positions compared)."""
import pytest

from checkpoints_convert import main


@pytest.mark.slow
def test_verify_cli_cp2(hf_dirs, mcore_dirs, capsys):
    assert main(["verify", "--hf", hf_dirs["qwen3_moe"], "--mcore", mcore_dirs["qwen3_moe"], "--cp", "2",
                 "--ep", "2", "--seq-len", "13"]) == 0
    out = capsys.readouterr().out
    assert "cp=2" in out and "top-1 agreement 100.00%" in out


def test_verify_cli_cp_layout_error(hf_dirs, mcore_dirs, capsys):
    # world-size-free rule: cp < 1 is refused before any rank starts, non-zero exit, the rule named
    assert main(["verify", "--hf", hf_dirs["qwen3"], "--mcore", mcore_dirs["qwen3"], "--cp", "0"]) != 0
    assert "cp=0 must be >= 1" in capsys.readouterr().err
