"""What ``cpu_compat`` binds for megatron-core 0.19.2's Gated DeltaNet package, and the release it accepts.

0.19.2's ``gated_delta_net/`` imports the fla names into ``common.py`` and ``gdn.py`` separately, so the torch
kernels must be bound in each module that reads them; its conv is fla's ``causal_conv1d`` outside deterministic
mode, so the torch stand-in must equal megatron's own ``nn.Conv1d(padding=w-1)`` path."""
import pytest
import torch
import torch.nn.functional as F

from megatron_s3ac.models import cpu_compat


def test_torch_causal_conv1d_equals_megatron_conv1d_path():
    g = torch.Generator().manual_seed(0)
    b, s, d, w = 2, 11, 6, 4
    x = torch.randn(b, s, d, generator=g)
    conv = torch.nn.Conv1d(d, d, kernel_size=w, groups=d, padding=w - 1, bias=True)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(d, 1, w, generator=g))
        conv.bias.copy_(torch.randn(d, generator=g))
    ref = F.silu(conv(x.transpose(1, 2))[..., :s]).transpose(1, 2)  # gdn.py's deterministic branch
    y, state = cpu_compat._torch_causal_conv1d(x=x, weight=conv.weight.squeeze(1), bias=conv.bias,
                                               activation="silu", initial_state=None, output_final_state=False,
                                               cu_seqlens=None)
    assert state is None and torch.equal(y, ref)
    with pytest.raises(NotImplementedError, match="cu_seqlens"):
        cpu_compat._torch_causal_conv1d(x, conv.weight.squeeze(1), cu_seqlens=torch.tensor([0, s]))


def test_installed_release_is_supported_and_the_torch_kernels_are_bound_where_read():
    cpu_compat.require_supported_megatron()
    if cpu_compat.have_fla():
        pytest.skip("flash-linear-attention installed: its kernels are used")
    assert cpu_compat.patch_missing_fla() and cpu_compat.torch_gdn_in_use()
    from megatron.core.ssm.gated_delta_net import common, gdn

    pkg, mods = cpu_compat._gdn_kernel_modules()
    assert mods == [pkg, common, gdn]
    assert common.l2norm is cpu_compat._torch_l2norm and common.HAVE_FLA
    assert gdn.chunk_gated_delta_rule is cpu_compat._torch_chunk_gated_delta_rule
    assert gdn.causal_conv1d is cpu_compat._torch_causal_conv1d


def test_release_lines():
    """0.19.2 only: 0.16.1 (Python 3.11) was dropped (docs/environment.md)."""
    assert str(cpu_compat.MCORE_SUPPORTED) == "<0.20,>=0.19.2"
    for good in ("0.19.2", "0.19.2+ba40176"):
        assert cpu_compat.require_supported_megatron(good) == good
    for bad in ("0.16.1", "0.18.2", "0.20.0", "garbage"):
        with pytest.raises(cpu_compat.UnsupportedMegatronCore, match="0.19.2"):
            cpu_compat.require_supported_megatron(bad)
