"""What megatron-core actually allocates for a model's states on this rank (the planner's reference).

Used by the calibration tests (on gloo CPU ranks) and the device check. ``measure_states`` builds the
actor or critic at ``layout``, wraps it in megatron's DDP and distributed optimizer exactly as the
trainer does (``models.optim``), takes one optimizer step so Adam's moments exist, and returns the
bytes of the tensors: the DDP param and grad buffers (dense and expert-parallel) and the optimizer's
fp32 main-param shards and moments.
"""
from __future__ import annotations

import contextlib


def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


def _optimizer_bytes(opt) -> int:
    import torch

    subs = getattr(opt, "chained_optimizers", None) or [opt]
    seen, total = set(), 0
    for o in subs:
        tensors = []
        for group in getattr(o, "shard_fp32_from_float16_groups", []) or []:
            tensors += list(group)
        inner = getattr(o, "optimizer", None)
        if inner is not None:
            for st in inner.state.values():
                tensors += [v for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
        for t in tensors:
            key = (t.data_ptr(), t.numel())
            if key not in seen:
                seen.add(key)
                total += _tensor_bytes(t)
    return total


def measure_states(hf: dict, layout_kw: dict, dtype: str = "float32", critic: bool = False) -> dict:
    """Run on every rank (torch.distributed initialised). Returns this rank's allocation in bytes."""
    import torch
    from megatron.core import parallel_state as ps

    from megatron_s3ac.models.actor_critic import build_actor, build_critic, build_transformer_config
    from megatron_s3ac.models.optim import build_optimizer, wrap_ddp
    from megatron_s3ac.models.parallel import ParallelLayout, initialize_model_parallel
    from megatron_s3ac.models.registry import model_info

    info = model_info(hf)
    layout = ParallelLayout(**layout_kw)
    initialize_model_parallel(layout)
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    config = build_transformer_config(info, layout, tdtype)
    model = build_critic(info, config) if critic else build_actor(info, config)
    dense = sum(p.numel() for p in model.parameters() if getattr(p, "allreduce", True))
    expert = sum(p.numel() for p in model.parameters() if not getattr(p, "allreduce", True))
    ddp = wrap_ddp(model, config)
    opt = build_optimizer([ddp], lr=1e-4, bf16=tdtype == torch.bfloat16)
    for p in ddp.parameters():  # zero gradients in the buffers: the step only has to create Adam's moments
        if getattr(p, "main_grad", None) is not None:
            p.main_grad.zero_()
    opt.step()
    out = dict(dense=dense, expert=expert, param_buffer=0, grad_buffer=0, expert_param_buffer=0,
               expert_grad_buffer=0, optimizer=_optimizer_bytes(opt),
               pp_rank=ps.get_pipeline_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank(),
               edp_rank=ps.get_expert_data_parallel_rank(), tp_rank=ps.get_tensor_model_parallel_rank())
    for prefix, bufs in (("", ddp.buffers), ("expert_", ddp.expert_parallel_buffers)):
        for b in bufs:
            out[prefix + "param_buffer"] += _tensor_bytes(b.param_data) if b.param_data is not None else 0
            out[prefix + "grad_buffer"] += _tensor_bytes(b.grad_data)
    return out


def measure_many(cases: list) -> list[dict]:
    """``measure_states`` for each (hf, layout_kw, dtype, critic) in turn (one process start for all)."""
    return [measure_states(*c) for c in cases]


@contextlib.contextmanager
def saved_storages(model):
    """Inside the block, record every tensor autograd saves for backward: yields a dict
    {storage data_ptr: storage bytes}, each storage counted once, ``model``'s parameters excluded
    (sum of the values = the activation bytes held between forward and backward)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


def measure_activations(hf: dict, layout_kw: dict, dtype: str = "float32", seq_len: int = 256,
                        batch: int = 1, recompute: str = "none") -> dict:
    """Bytes of the tensors autograd keeps between one forward and its backward (one micro-batch,
    no pipeline), measured with ``torch.autograd.graph.saved_tensors_hooks``: every saved tensor's
    storage counted once, parameters excluded. The loss is the trainer's: token log-probs from the
    TP-sharded logits (models.logprobs). Run on every rank (torch.distributed initialised)."""
    import torch

    from megatron_s3ac.models.actor_critic import build_actor, build_transformer_config
    from megatron_s3ac.models.logprobs import vocab_parallel_log_probs
    from megatron_s3ac.models.parallel import ParallelLayout, initialize_model_parallel
    from megatron_s3ac.models.registry import model_info

    info = model_info(hf)
    layout = ParallelLayout(**layout_kw)
    initialize_model_parallel(layout)
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    # full: megatron's recompute_granularity="full", recompute_method="uniform", 1 layer per chunk
    config = build_transformer_config(info, layout, tdtype, recompute=recompute)
    model = build_actor(info, config)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, info.vocab_size, (batch, seq_len), generator=g)
    pos = torch.arange(seq_len).unsqueeze(0).expand(batch, -1)
    with saved_storages(model) as seen:
        logits = model(ids, pos, None)
        lp = vocab_parallel_log_probs(logits, ids, info.vocab_size)
    saved = sum(seen.values())
    lp.float().sum().backward()
    logit_bytes = logits.numel() * logits.element_size()
    return dict(saved=saved, logits=logit_bytes, tokens=batch * seq_len)


def measure_activations_many(cases: list) -> list[dict]:
    return [measure_activations(*c) for c in cases]
