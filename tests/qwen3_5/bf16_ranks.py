"""Rank body for tests/qwen3_5/test_bf16.py (module-level: the forkserver imports it by name)."""
import types

import torch


def router_hooks(model, record=None, replay=None):
    """Forward hooks on every megatron MoE router: record its outputs (probs, routing_map) or replace
    them by recorded ones cast to this run's dtypes, so a bf16 run uses the fp32 run's expert choices
    and weights (the discrete top-k choice is what bf16 flips; the rest is continuous error)."""
    from megatron.core.transformer.moe.router import TopKRouter

    def hook(name):
        def h(module, inputs, output):
            if record is not None:
                record[name] = tuple(t.detach().clone() for t in output)
            if replay is not None:
                return tuple(r.to(o.dtype) for r, o in zip(replay[name], output))
        return h

    return [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, TopKRouter)]


def use_legacy_gdn(model) -> None:
    """Run the GDN mixers as before the fp32 changes, to measure the 'before' figures: megatron-core's
    own numerics (decay from ``A_log.exp()`` in the parameter dtype), the torch l2norm in the input dtype,
    and the torch kernel returning q's dtype. The forward is already upstream's, so its own
    ``_compute_g_and_beta`` (undecorated), its kernel attribute and ``common.l2norm`` are swapped."""
    import inspect

    from megatron.core.ssm import gated_delta_net as gdn
    from megatron.core.ssm.gated_delta_net import common

    def l2norm(x, dim=-1, eps=1e-6):
        return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)

    upstream_g = inspect.unwrap(common._GDNBase._compute_g_and_beta)

    def forward(self, *args, **kwargs):
        saved = common.l2norm
        common.l2norm = l2norm
        try:
            return gdn.GatedDeltaNet.forward(self, *args, **kwargs)
        finally:
            common.l2norm = saved

    for m in model.modules():
        if isinstance(m, gdn.GatedDeltaNet):
            m.__dict__.setdefault("_s3ac_current_rule", m.gated_delta_rule)
            m.gated_delta_rule = gdn.torch_chunk_gated_delta_rule
            m._compute_g_and_beta = types.MethodType(upstream_g, m)
            m.forward = types.MethodType(forward, m)


def use_current_gdn(model) -> None:
    from megatron.core.ssm import gated_delta_net as gdn

    for m in model.modules():
        if isinstance(m, gdn.GatedDeltaNet):
            m.__dict__.pop("forward", None)
            m.__dict__.pop("_compute_g_and_beta", None)
            if "_s3ac_current_rule" in m.__dict__:
                m.gated_delta_rule = m.__dict__.pop("_s3ac_current_rule")


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def bf16_vs_fp32(cfg, mcore_dir, tokens, mixer_input):
    """The converted checkpoint built at fp32 and at bf16 (params_dtype + bf16 in the TransformerConfig,
    the same weights), current GDN numerics and the legacy ones ('legacy_*'). Returns a dict:

    * logits (fp32 copies, [b, s, V]): ``fp32``, ``bf16``, ``bf16_fp32_routes`` (the fp32 run's router
      outputs replayed), ``legacy_bf16``, ``legacy_bf16_fp32_routes``;
    * ``fp32_identical``: fp32 logits and gradients of the current GDN == the legacy ones, bit for bit;
    * ``bf16_grads_finite``, ``bf16_gdn_grads`` (GDN A_log / conv1d params with a non-zero bf16 grad);
    * ``mixer`` / ``legacy_mixer``: {layer: bf16 GDN mixer output [s, b, h]} for ``mixer_input`` (bf16).
    """
    from megatron.core import parallel_state
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from megatron_s3ac.convert.verify import load_actor, make_layout

    b, s = tokens.shape
    pos = torch.arange(s).expand(b, -1)
    out, routes = {}, {}

    def loss(info, logits):
        lp = torch.log_softmax(logits[..., :info.vocab_size].float(), -1)
        return -lp[:, :-1].gather(-1, tokens[:, 1:, None]).mean()

    # fp32: the current forward must equal megatron's own, logits and gradients
    info, model = load_actor(cfg, mcore_dir, make_layout(), torch.float32)
    hooks = router_hooks(model, record=routes)
    logits = model(tokens, pos, None)
    for h in hooks:
        h.remove()
    loss(info, logits).backward()
    grads = _grads(model)
    out["fp32"] = logits.detach()[..., :info.vocab_size].clone()
    model.zero_grad()
    for p in model.parameters():
        p.grad = None
    use_legacy_gdn(model)
    legacy = model(tokens, pos, None)
    loss(info, legacy).backward()
    out["fp32_identical"] = bool(torch.equal(legacy, logits) and all(
        torch.equal(g, grads[n]) for n, g in _grads(model).items()) and len(grads) == len(_grads(model)))
    parallel_state.destroy_model_parallel()

    info, model = load_actor(cfg, mcore_dir, make_layout(), torch.bfloat16)
    gdns = {i: layer.self_attention for i, layer in enumerate(model.decoder.layers)
            if isinstance(layer.self_attention, GatedDeltaNet)}
    for tag, setup in (("", use_current_gdn), ("legacy_", use_legacy_gdn)):
        setup(model)
        with torch.no_grad():
            out[tag + "bf16"] = model(tokens, pos, None)[..., :info.vocab_size].float()
            hooks = router_hooks(model, replay=routes)
            out[tag + "bf16_fp32_routes"] = model(tokens, pos, None)[..., :info.vocab_size].float()
            for h in hooks:
                h.remove()
            out[tag + "mixer"] = {i: m(mixer_input, None)[0].float() for i, m in gdns.items()}
    use_current_gdn(model)
    loss(info, model(tokens, pos, None)).backward()
    g = _grads(model)
    out["bf16_grads_finite"] = all(bool(torch.isfinite(t).all()) and t.dtype == torch.bfloat16 for t in g.values())
    out["bf16_gdn_grads"] = sum(1 for n, t in g.items() if ("A_log" in n or "conv1d" in n) and t.abs().sum() > 0)
    parallel_state.destroy_model_parallel()
    return out
