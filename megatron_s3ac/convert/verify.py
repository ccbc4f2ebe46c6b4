"""Check a converted checkpoint numerically: transformers vs megatron logits on the same tokens.

``verify(hf_dir, mcore_dir, tp, pp, ep, cp=1)`` starts ``pp * lcm(tp * cp, etp * ep)`` CPU gloo ranks, builds the
actor at that layout (fp32; layers that do not divide by pp are split by ``ParallelLayout.resolve``), loads the torch_dist checkpoint with ``dist_checkpointing.load``, runs a
fixed random batch through megatron's pipeline schedule, gathers the TP-sharded logits [b, s, Vp] and
compares them over the real vocab with transformers' logits of the HF checkpoint. With ``cp`` > 1 the
batch is right-padded to the layout's ``seq_multiple`` (causal: the real positions are unaffected), every
CP rank computes its load-balanced chunks, and the logits are gathered over CP before the comparison.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class VerifyResult:
    max_abs_diff: float
    top1_agreement: float
    hf_logits: torch.Tensor  # [b, s, V]
    mcore_logits: torch.Tensor  # [b, s, V]

    def summary(self) -> str:
        return f"max abs logit diff {self.max_abs_diff:.3e}, top-1 agreement {self.top1_agreement * 100:.2f}%"


def load_actor(hf_config, mcore_dir: str, layout, dtype=torch.float32):
    """On every rank of an initialised group: build the actor at ``layout`` and load ``mcore_dir``."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_s3ac.models.actor_critic import build_actor, build_transformer_config
    from megatron_s3ac.models.parallel import initialize_model_parallel
    from megatron_s3ac.models.registry import model_info

    info = model_info(hf_config)
    layout.validate(info, dist.get_world_size())
    initialize_model_parallel(layout, seed=1)
    model = build_actor(info, build_transformer_config(info, layout, dtype))
    state = dist_checkpointing.load(model.sharded_state_dict(), mcore_dir)
    model.load_state_dict(state)
    return info, model.eval()


def make_layout(tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None, cp: int = 1):
    """ParallelLayout with the usual expert-TP choice: etp = tp without EP, 1 with EP."""
    from megatron_s3ac.models.parallel import ParallelLayout

    return ParallelLayout(tp=tp, pp=pp, ep=ep, cp=cp, etp=etp if etp is not None else (tp if ep == 1 else 1))


def world_size_for(layout) -> int:
    """Smallest world that fits both the dense (tp*cp*pp) and the expert (etp*ep*pp) grids."""
    a, b = layout.tp * layout.cp, layout.etp * layout.ep
    return layout.pp * (a * b // math.gcd(a, b))


def _rank_logits(hf_config, mcore_dir: str, layout, tokens: torch.Tensor):
    """Rank body: full-vocab logits [b, s, Vp] on the first rank of the last stage, else None."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_s3ac.models.pipeline import forward_backward

    tp, pp = layout.tp, layout.pp
    _, model = load_actor(hf_config, mcore_dir, layout)

    from megatron_s3ac.models.context_parallel import gather_from_cp, pad_len

    def keep_logits(batch, output):
        return output.sum() * 0, torch.tensor(1), {"logits": gather_from_cp(output.detach(), 1)}

    n = tokens.shape[1]
    padded = torch.zeros(tokens.shape[0], pad_len(n, layout.seq_multiple), dtype=tokens.dtype)
    padded[:, :n] = tokens
    with torch.no_grad():
        out = forward_backward([model], [{"input_ids": padded}], keep_logits, forward_only=True)
    if not (pp == 1 or ps.is_pipeline_last_stage()):
        return None
    local = out[0]["logits"][:, :n]  # [b, s, Vp / tp]
    if tp > 1:
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
        local = torch.cat(parts, dim=-1)
    first = (ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
             and ps.get_context_parallel_rank() == 0)
    return local if first else None


def megatron_logits(hf_config, mcore_dir: str, tokens: torch.Tensor, layout):
    from megatron_s3ac.models.gloo_ranks import run_distributed

    results = run_distributed(_rank_logits, world_size_for(layout), hf_config, mcore_dir, layout, tokens)
    return next(r for r in results if r is not None)


def hf_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


def verify(hf_dir: str, mcore_dir: str, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
           batch: int = 2, seq: int = 16, seed: int = 0, cp: int = 1) -> VerifyResult:
    from megatron_s3ac.convert.dcp_io import DistcpCheckpoint
    from megatron_s3ac.convert.safetensors_io import HFCheckpoint
    from megatron_s3ac.models.registry import load_hf_config, model_info

    cfg = load_hf_config(hf_dir)
    info = model_info(cfg)  # vocab_size etc. from the text config (VL checkpoints nest it)
    # both checkpoints' files are complete (named if not) before transformers and N megatron ranks load them
    HFCheckpoint(hf_dir).close()
    DistcpCheckpoint(mcore_dir).close()
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, info.vocab_size, (batch, seq), generator=g)
    ref = hf_logits(hf_dir, tokens)
    from megatron_s3ac.convert.plan import ConversionError
    from megatron_s3ac.models.parallel import LayoutError

    # Layers that do not divide by pp are split automatically (ParallelLayout.resolve).
    try:
        layout = make_layout(tp, pp, ep, etp if info.is_moe else None, cp).resolve(info.num_layers)
        layout.validate(info, world_size_for(layout))  # fail here, not inside N ranks
    except LayoutError as e:
        raise ConversionError(f"layout tp={tp} pp={pp} ep={ep} cp={cp}: {e}") from None
    got = megatron_logits(cfg, mcore_dir, tokens, layout)[..., :info.vocab_size].float()
    diff = (got - ref).abs().max().item()
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return VerifyResult(diff, top1, ref, got)
