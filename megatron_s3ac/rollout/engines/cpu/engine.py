"""CPU rollout engine on transformers' model classes: batched sampling with a KV cache.

It is the engine of the CPU demo and of the tests, so it is exact rather than clever:
- prompts (x n_samples) are left-padded into one batch; one prefill, then one token per step with
  a DynamicCache; finished rows are dropped from the batch (and the cache) as soon as they finish.
- log-probs: log_softmax(logits / temperature) of the sampled token, *before* top-p / top-k
  truncation. That is SGLang's default and how the trainer computes the log-prob of the same token,
  so it is the behaviour policy's log-prob. Greedy (temperature 0) reports temperature-1 log-probs.
- routed experts: forward hooks on each MoE router record its top-k ids; the result uses SGLang's
  R3 layout (see base.py).
- update_weights takes HF checkpoint names (per-expert tensors, as on disk and as SGLang loads them)
  or the in-memory names of the transformers module (fused experts), with shape checks. The text
  model's tensors may come under either HF prefix, ``model.language_model.`` (vision-language
  checkpoints) or ``model.`` (causal-LM ones), whichever class the engine holds (``LM_PREFIXES``).
- vision-language checkpoints (e.g. ``Qwen3_5MoeForConditionalGeneration``): by default the engine
  holds transformers' text-only causal LM of them (``AutoModelForCausalLM``, the vision tower is not
  loaded); ``multimodal=True`` loads the full model (``AutoModelForImageTextToText``, as SGLang does),
  whose vision weights a weight sync of the language model leaves untouched. That model serves image
  prompts (``generate(..., images=[ImageInputs | None, ...])``): the prefill takes the images'
  pixel_values / image_grid_thw, the vision tower's embeddings replace the placeholder tokens, and the
  positions are transformers' 3-D mRoPE ones (``get_rope_index`` on the left-padded batch, then text
  positions + the row's rope delta while decoding), as ``Qwen3_5MoeForConditionalGeneration.generate``
  builds them (modeling_qwen3_5_moe.py ``_prepare_position_ids_for_generation``).
"""
from __future__ import annotations

import difflib
import re
import threading
import time
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from megatron_s3ac.rollout.base import RolloutEngine, Sample, SamplingParams, check_images, routed_experts_dtype

_LAYER_RE = re.compile(r"layers\.(\d+)\.")

# HF names of a text model's tensors: ``model.language_model.<rest>`` in a vision-language checkpoint
# (Qwen3_5MoeForConditionalGeneration, Qwen3-VL, ...; lm_head and model.visual.* at the top level),
# ``model.<rest>`` in a causal-LM one. The trainer's exporter names tensors like the checkpoint it was
# converted from (convert/<family>.py), the engine may hold either class (a text-only causal LM is
# what AutoModelForCausalLM makes of a VL checkpoint or config): ``_WeightMap.resolve`` maps one
# convention onto the other. This is the only place the engine handles that prefix.
LM_PREFIXES = ("model.language_model.", "model.")


# ----------------------------------------------------------------------------------------------
# Router capture
# ----------------------------------------------------------------------------------------------
def find_moe_routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Global layer index -> router module of that layer's sparse MoE block.

    Generic over transformers' MoE families (qwen2_moe, qwen3_moe, qwen3_next, qwen3_5_moe, ...):
    a router is a module whose class name ends in "Router" (e.g. Qwen3MoeTopKRouter) and whose
    path contains "layers.<i>.". Vision towers and other stacks are skipped by requiring the
    router's path to sit under the text model's decoder layers (the first "layers" stack found).
    """
    routers: dict[int, torch.nn.Module] = {}
    stack_prefix = None
    for name, module in model.named_modules():
        if not type(module).__name__.endswith("Router"):
            continue
        match = None
        for match in _LAYER_RE.finditer(name):
            pass
        if match is None:
            continue
        prefix = name[: match.start()]
        if stack_prefix is None:
            stack_prefix = prefix
        if prefix != stack_prefix:
            continue  # a second stack (e.g. a vision tower); R3 covers the text decoder only
        routers[int(match.group(1))] = module
    return routers


class _RouterCapture:
    """Records the top-k expert ids each router chose during one forward: layer -> [N, top_k]."""

    def __init__(self, routers: dict[int, torch.nn.Module], top_k: int):
        self.top_k = top_k
        self.enabled = False
        self.current: dict[int, torch.Tensor] = {}
        self._handles = [m.register_forward_hook(self._hook(i)) for i, m in routers.items()]

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            if not self.enabled:
                return
            # transformers' routers return (logits, scores, indices); take the integer tensor.
            outs = output if isinstance(output, (tuple, list)) else (output,)
            ids = next((t for t in reversed(outs) if torch.is_tensor(t) and not t.is_floating_point()), None)
            if ids is None:  # a router that returns logits only: apply the usual softmax top-k
                ids = torch.topk(outs[0].float().softmax(-1), self.top_k, dim=-1).indices
            self.current[layer] = ids.detach().reshape(-1, self.top_k).cpu()  # routes are assembled on the host

        return hook

    def pop(self) -> dict[int, torch.Tensor]:
        out, self.current = self.current, {}
        return out

    def remove(self):
        for h in self._handles:
            h.remove()


# ----------------------------------------------------------------------------------------------
# HF name -> parameter map
# ----------------------------------------------------------------------------------------------
class _WeightMap:
    """Maps HF names to where their values live in the transformers module.

    transformers 5 fuses MoE experts in memory (experts.gate_up_proj [E, 2I, H]) while checkpoints
    (and SGLang) use one tensor per expert and projection. Rather than re-implementing that layout,
    we run transformers' own reverse conversion, first on meta views (free; maps every tensor that
    comes back as a view, ``_map_views``), then, for parameters a conversion copies, on *index*
    tensors: each checkpoint tensor comes back holding the flat positions of its elements inside the
    in-memory parameter (``_map_indices``).
    """

    def __init__(self, model: torch.nn.Module):
        self.params: dict[str, torch.nn.Parameter] = dict(model.named_parameters(remove_duplicate=False))
        unique: dict[int, str] = {}
        for name, p in self.params.items():
            unique.setdefault(id(p), name)
        self.canonical = {name: unique[id(p)] for name, p in self.params.items()}  # tied -> owner
        self.parts: dict[str, tuple[str, object, tuple[int, ...]]] = {}
        todo = self._map_views(model)
        if todo:
            self._map_indices(model, todo)
        # which checkpoint names together fill each parameter (to know when a param is complete)
        self.parts_of: dict[str, set[str]] = {}
        for ckpt_name, (owner, _, _) in self.parts.items():
            self.parts_of.setdefault(owner, set()).add(ckpt_name)

    def _map_views(self, model) -> set[str]:
        """Fast pass: run the reverse conversion on *meta* views of one flat meta base per parameter
        (no memory, no copies). A checkpoint tensor that comes back as a contiguous view of a base is
        the slice [storage_offset, + numel) of that parameter: every unconverted tensor (dense models:
        all of them) and split-only conversions. Returns the parameters not fully covered this way
        (a conversion that copies), which ``_map_indices`` maps with index tensors."""
        from transformers.core_model_loading import revert_weight_conversion

        owners = [n for n in self.params if self.canonical[n] == n]
        bases = {n: torch.empty(self.params[n].numel(), device="meta") for n in owners}
        base_owner = {id(b): n for n, b in bases.items()}
        views = {n: bases[self.canonical[n]].view(p.shape) for n, p in self.params.items()}
        covered: dict[str, set[tuple[int, int]]] = {}
        for ckpt_name, t in revert_weight_conversion(model, dict(views)).items():
            owner = base_owner.get(id(t._base)) if t._base is not None else None
            if owner is None or not t.is_contiguous():
                continue
            lo = t.storage_offset()
            self.parts[ckpt_name] = (owner, slice(lo, lo + t.numel()), tuple(t.shape))
            covered.setdefault(owner, set()).add((lo, lo + t.numel()))
        todo = set()
        for n in owners:
            spans = sorted(covered.get(n, ()))
            at = 0
            for lo, hi in spans:  # distinct spans must tile the parameter exactly
                if lo != at:
                    break
                at = hi
            if at != self.params[n].numel():
                todo.add(n)
        if todo:  # re-mapped from scratch by the index pass
            self.parts = {k: v for k, v in self.parts.items() if v[0] not in todo}
        return todo

    def _map_indices(self, model, todo: set[str]) -> None:
        """Exact pass for the parameters in ``todo``: run the reverse conversion on *index* tensors;
        each checkpoint tensor comes back holding the flat positions of its elements in the
        in-memory parameter (an int64 per element of these parameters, briefly)."""
        from transformers.core_model_loading import revert_weight_conversion

        starts, index_sd, offset = [], {}, 0
        for name, p in self.params.items():
            if self.canonical[name] == name and name in todo:
                index_sd[name] = torch.arange(offset, offset + p.numel()).view(p.shape)
                starts.append((offset, name))
                offset += p.numel()
        for name, owner in self.canonical.items():
            if owner in todo:
                index_sd.setdefault(name, index_sd[owner])
        starts_t = torch.tensor([s for s, _ in starts])
        start_names = [n for _, n in starts]
        for ckpt_name, idx in revert_weight_conversion(model, dict(index_sd)).items():
            flat = idx.reshape(-1)
            k = int(torch.searchsorted(starts_t, flat[0], right=True)) - 1
            owner, base = start_names[k], int(starts_t[k])
            local = flat - base
            if local.numel() and (local.min() < 0 or local.max() >= self.params[owner].numel()):
                raise RuntimeError(f"checkpoint tensor {ckpt_name} spans several parameters")
            lo = int(local[0])
            contiguous = bool(torch.equal(local, torch.arange(lo, lo + local.numel())))
            where = slice(lo, lo + local.numel()) if contiguous else local.to(self.params[owner].device)
            self.parts[ckpt_name] = (owner, where, tuple(idx.shape))

    def buffer(self, name: str, shape, dtype) -> Optional[torch.Tensor]:
        """The engine memory that holds checkpoint tensor ``name`` as a contiguous ``shape`` view, if
        it is one (a whole parameter or a contiguous slice of one) of that dtype; else None."""
        name = self.resolve(name)
        if name in self.params:
            p = self.params[self.canonical[name]]
            ok = tuple(p.shape) == tuple(shape) and p.dtype == dtype and p.is_contiguous()
            return p.data if ok else None
        if name in self.parts:
            owner, where, part_shape = self.parts[name]
            p = self.params[owner]
            if isinstance(where, slice) and tuple(part_shape) == tuple(shape) and p.dtype == dtype and p.is_contiguous():
                return p.data.view(-1)[where].view(shape)
        return None

    def names(self) -> list[str]:
        return sorted(set(self.parts) | set(self.params))

    def expected(self, name: str, label: Optional[str] = None) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) the engine holds checkpoint tensor ``name`` in; KeyError naming ``label`` (default: the
        name) with the closest known names if it holds no such tensor."""
        name = self.resolve(name)
        if name in self.params:
            p = self.params[self.canonical[name]]
            return tuple(p.shape), p.dtype
        if name in self.parts:
            owner, _, shape = self.parts[name]
            return tuple(shape), self.params[owner].dtype
        close = difflib.get_close_matches(name, self.names(), n=3)
        raise KeyError(f"unknown weight name {label or name!r}; closest known names: {close}")

    def check(self, name: str, shape: Sequence[int], dtype: Optional[torch.dtype]) -> None:
        """Raise as ``update_weights`` would for (name, shape, dtype), before anything is loaded: KeyError for an
        unknown name, ValueError for a wrong shape or a dtype that cannot hold the weight (not a float; an fp8
        other than float8_e4m3fn). An fp8 pair: the float8_e4m3fn half has the weight's shape, the ``_scale_inv``
        half its block-scale shape (``convert.fp8.scale_shape``)."""
        from megatron_s3ac.convert.fp8 import SCALE_SUFFIX, scale_shape

        shape = tuple(int(s) for s in shape)
        if dtype is not None and (not dtype.is_floating_point or dtype.is_complex):
            raise ValueError(f"dtype mismatch for {name}: got {dtype}; the engine's weights are floating point")
        if dtype is not None and "float8" in str(dtype) and dtype != torch.float8_e4m3fn:
            raise ValueError(f"dtype mismatch for {name}: {dtype} is not an fp8 the engine dequantizes "
                             f"(float8_e4m3fn with block scales only)")
        if name.endswith(SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            want = scale_shape(self.expected(base, label=f"{name} (the fp8 scale of {base}, not a weight of "
                                                          f"this engine)")[0])
        else:
            want = self.expected(name)[0]
        if shape != want:
            raise ValueError(f"shape mismatch for {name}: got {shape}, expected {want}")

    def resolve(self, name: str) -> str:
        """``name`` if known, else the same tensor under the other text-model prefix (``LM_PREFIXES``)
        if that one is known, else ``name`` unchanged (``load`` then reports it)."""
        if name in self.params or name in self.parts:
            return name
        for p in LM_PREFIXES:
            if name.startswith(p):
                rest = name[len(p):]
                for q in LM_PREFIXES:
                    if q != p and (q + rest in self.params or q + rest in self.parts):
                        return q + rest
                break  # the longest matching prefix decides
        return name

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> tuple[str, Optional[str]]:
        """Copy one tensor in; returns (owner param name, checkpoint part name or None if whole)."""
        name = self.resolve(name)
        if name in self.params:
            owner = self.canonical[name]
            param = self.params[owner]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"shape mismatch for {name}: got {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            if not _same_memory(tensor, param):  # already in place (see CPUEngine.weight_buffer)
                param.copy_(tensor.to(param.dtype))
            return owner, None
        if name in self.parts:
            owner, where, shape = self.parts[name]
            if tuple(tensor.shape) != shape:
                raise ValueError(f"shape mismatch for {name}: got {tuple(tensor.shape)}, expected {shape}")
            flat = self.params[owner].view(-1)
            if isinstance(where, slice) and _same_memory(tensor, flat[where]):
                return owner, name
            src = tensor.detach().reshape(-1).to(device=flat.device, dtype=flat.dtype)
            if isinstance(where, slice):
                flat[where] = src
            else:
                flat.index_copy_(0, where, src)
            return owner, name
        close = difflib.get_close_matches(name, self.names(), n=3)
        raise KeyError(f"unknown weight name {name!r}; closest known names: {close}")


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype \
        and a.is_contiguous() and b.is_contiguous()


# ----------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------
def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] fp32 -> (token ids [B] int64, log-probs [B] fp32 of log_softmax(logits / T))."""
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, F.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    scaled = logits / params.temperature
    logprobs = F.log_softmax(scaled, -1)
    filtered = scaled
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = filtered.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        filtered = torch.full_like(filtered, float("-inf")).scatter(-1, order, sorted_logits)
    tokens = torch.multinomial(filtered.softmax(-1), 1, generator=generator)[:, 0]
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


# ----------------------------------------------------------------------------------------------
# Engine
# ----------------------------------------------------------------------------------------------
class CPUEngine(RolloutEngine):
    """Generator on a transformers causal LM (fp32 by default), batched, with a KV cache.

    ``device``: where the model runs (default: where its parameters are; CPU here, ``cuda`` for the
    single-GPU loop without SGLang, ``rollout.engine: hf``), with the dtype it was loaded in (e.g.
    bf16 on CUDA). Sampled tokens, log-probs and routes come back on the host."""

    def __init__(self, model: torch.nn.Module, tokenizer=None, device=None):
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.num_layers = int(self.config.num_hidden_layers)
        self.routers = find_moe_routers(model)
        self.moe_layers = sorted(self.routers)
        self.top_k = int(getattr(self.config, "num_experts_per_tok", 0) or 0)
        num_experts = int(getattr(self.config, "num_experts", 0) or getattr(self.config, "n_routed_experts", 0) or 0)
        self.routes_dtype = routed_experts_dtype(num_experts) if self.routers else None
        self._capture = _RouterCapture(self.routers, self.top_k) if self.routers else None
        # built now (engine start-up), not in the first weight sync: the meta-view pass costs no memory
        self._weight_map: Optional[_WeightMap] = _WeightMap(self.model)
        self._stale: set[str] = set()  # params whose memory holds no valid weights (after sleep)
        self._partial: dict[str, set[str]] = {}
        self._backup: Optional[dict[str, torch.Tensor]] = None
        # weights the trainer's sync never sends (a frozen vision tower, ``model.visual.``): kept through sleep()
        # as loaded (nothing would refill them); EngineFactory(resident_prefixes=...) sets it
        self.resident_prefixes: tuple[str, ...] = ()
        self._shapes = {n: (p.shape, p.dtype) for n, p in self._unique_params()}
        gen_cfg = getattr(model, "generation_config", None)
        eos = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
        eos = eos if eos is not None else getattr(self.config, "eos_token_id", None)
        self.eos_token_ids = set([eos] if isinstance(eos, int) else (eos or []))
        pad = getattr(self.config, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else 0
        self._paused = threading.Event()  # pause_generation / continue_generation (partial rollout)
        from megatron_s3ac.faults import decode_delay

        self._decode_delay = decode_delay()  # a testing seam (0 unless S3AC_TESTING_DECODE_DELAY is set)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, tokenizer="auto", dtype=torch.float32, multimodal: bool = False,
                        device=None, **kwargs) -> "CPUEngine":
        """Load an HF directory; tokenizer="auto" loads the directory's tokenizer if it has one.
        ``multimodal``: load a vision-language checkpoint as the full model (vision tower included)
        instead of transformers' text-only causal LM of it."""
        from transformers import AutoTokenizer

        if _fp8_checkpoint(path):  # block-FP8 (SGLang layout): dequantized on load, see _from_fp8
            return _from_fp8(cls, path, tokenizer, dtype, multimodal, **kwargs)
        model = _auto_class(multimodal).from_pretrained(path, dtype=dtype, **kwargs)
        if tokenizer == "auto":
            try:
                tokenizer = AutoTokenizer.from_pretrained(path)
            except (OSError, ValueError):
                tokenizer = None
        return cls(model, tokenizer=tokenizer, device=device)

    @classmethod
    def from_config(cls, config, state_dict=None, tokenizer=None, dtype=torch.float32, seed: int = 0,
                    multimodal: bool = False, device=None) -> "CPUEngine":
        """Build from an HF config; weights random (seeded) unless state_dict (HF names) is given.
        ``multimodal`` as in ``from_pretrained``."""
        torch.manual_seed(seed)
        model = _auto_class(multimodal).from_config(config, dtype=dtype)
        engine = cls(model, tokenizer=tokenizer, device=device)
        if state_dict is not None:
            engine.update_weights(state_dict.items() if hasattr(state_dict, "items") else state_dict)
        return engine

    def _unique_params(self):
        return self.model.named_parameters()  # tied parameters appear once, under their first name

    def _releasable(self):
        """The parameters sleep() frees: all but the ``resident_prefixes`` ones."""
        pre = tuple(self.resident_prefixes)
        return ((n, p) for n, p in self._unique_params() if not (pre and n.startswith(pre)))

    # -- weights --------------------------------------------------------------------------------
    def _get_weight_map(self) -> _WeightMap:
        if self._is_asleep():
            raise RuntimeError("engine is asleep: call wake() first")
        if self._weight_map is None:  # built on first use: it briefly holds an int64 index per weight
            self._weight_map = _WeightMap(self.model)
        return self._weight_map

    def weight_buffer(self, name: str, shape, dtype) -> Optional[torch.Tensor]:
        """Where ``update_weights`` would put checkpoint tensor ``name`` (a view of the engine's own
        parameter memory), or None. An exporter in this process may assemble the tensor right there
        and then pass that view to ``update_weights``, which sees the data in place and skips the copy
        (the weight sync of a colocated HF engine: one copy from the trainer's shards, no staging)."""
        return self._get_weight_map().buffer(name, shape, dtype)

    def hf_weight_names(self) -> list[str]:
        """Every name update_weights accepts (checkpoint names and in-memory names; the text model's
        names are accepted under the other ``LM_PREFIXES`` prefix too, not listed here)."""
        return self._get_weight_map().names()

    def check_weights(self, names: Sequence[str], shapes: Sequence[Sequence[int]],
                      dtypes: Optional[Sequence[torch.dtype]] = None) -> None:
        """Raise naming the first tensor ``update_weights`` would refuse (KeyError: unknown name; ValueError: wrong
        shape or dtype, see ``_WeightMap.check``); loads nothing. A caller streaming one update in several calls
        (``RemoteEngine``) checks the whole update here first."""
        weight_map = self._get_weight_map()
        for i, (name, shape) in enumerate(zip(names, shapes)):
            weight_map.check(name, shape, None if dtypes is None else _as_torch_dtype(dtypes[i]))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (hf_name, tensor) pairs, all or nothing: every name, shape and dtype is checked before the first
        tensor is written (KeyError on an unknown name, ValueError on a bad shape or dtype, naming the tensor; the
        engine is then exactly as before). Block-FP8 weights come as (name, float8_e4m3fn) + (name + "_scale_inv",
        float32) pairs, in either order and possibly in different calls; each is loaded dequantized
        (q * scale_inv, convert/fp8.py) once both halves have arrived, and ``generate`` refuses to run while one is
        unpaired. A lazy stream is collected first (references to its tensors, no copies)."""
        items = list(named_tensors.items() if hasattr(named_tensors, "items") else named_tensors)
        items = [(name, torch.as_tensor(t)) for name, t in items]
        self.check_weights([n for n, _ in items], [tuple(t.shape) for _, t in items], [t.dtype for _, t in items])
        weight_map = self._get_weight_map()
        pairs = getattr(self, "_fp8_pairs", None)
        held = None if pairs is None else (dict(pairs.weights), dict(pairs.scales))
        try:  # joining fp8 halves changes the pending pairs: put them back if a pair cannot be dequantized
            ready = list(self._dequantized(items))
        except BaseException:
            if held is not None:
                pairs.weights, pairs.scales = held
            elif getattr(self, "_fp8_pairs", None) is not None:
                self._fp8_pairs = None
            raise
        for name, tensor in ready:
            owner, part = weight_map.load(name, tensor)
            if part is None:
                self._stale.discard(owner)
                self._partial.pop(owner, None)
            elif owner in self._stale:
                done = self._partial.setdefault(owner, set())
                done.add(part)
                if done >= weight_map.parts_of[owner]:
                    self._stale.discard(owner)
                    self._partial.pop(owner)
        self.flush_cache()

    def _dequantized(self, named_tensors):
        """The stream with fp8 + scale pairs joined and dequantized (plain tensors pass through)."""
        from megatron_s3ac.convert.fp8 import Fp8Pairs

        for name, tensor in named_tensors:
            if name.endswith("_scale_inv") or getattr(tensor, "dtype", None) == torch.float8_e4m3fn:
                if getattr(self, "_fp8_pairs", None) is None:
                    self._fp8_pairs = Fp8Pairs()
                yield from self._fp8_pairs.feed(name, tensor)
            else:
                yield name, tensor

    # -- memory ---------------------------------------------------------------------------------
    def _is_asleep(self) -> bool:
        # sleep() empties every weight, so the first one tells (called per weight during a sync: walking all
        # parameters each time cost ~0.15 s per sync of a 0.4 GB model)
        for n, p in self._releasable():
            return p.numel() == 0 and self._shapes[n][0].numel() > 0
        return False

    def sleep(self, keep_cpu_backup: bool = False) -> None:
        """Free every weight's storage (tied weights stay tied: each Parameter object is kept).

        Parameters under ``resident_prefixes`` (weights no sync refills: a frozen vision tower) are kept as they
        are. Without keep_cpu_backup the values are gone, as SGLang's release without
        enable_weights_cpu_backup: after wake() the engine refuses to generate until
        update_weights has refilled every parameter. With it, the tensors are kept aside (on CPU
        this frees nothing; it exists to exercise the same sleep/wake flow as the GPU engine).
        """
        if self._is_asleep():
            return
        self._backup = {} if keep_cpu_backup else None
        for name, p in self._releasable():
            if keep_cpu_backup:
                self._backup[name] = p.data
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)

    def wake(self) -> None:
        """Re-allocate weights: restored from the backup, or uninitialised and marked stale."""
        if not self._is_asleep():
            return
        for name, p in self._releasable():
            shape, dtype = self._shapes[name]
            if self._backup is not None:
                p.data = self._backup[name]
            else:
                p.data = torch.empty(shape, dtype=dtype, device=self.device)
                self._stale.add(name)
        self._backup = None

    def flush_cache(self) -> None:
        """Nothing to drop: the KV cache lives only inside one generate() call."""

    # -- generation -----------------------------------------------------------------------------
    def _check_ready(self):
        if self._is_asleep():
            raise RuntimeError("engine is asleep: call wake() first")
        if getattr(self, "_fp8_pairs", None) is not None:
            self._fp8_pairs.check_complete()  # an fp8 weight whose scale never came (or vice versa)
        if self._stale:
            missing = sorted(self._stale)
            raise RuntimeError(f"weights not loaded since wake(): {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        n_samples: int = 1,
        return_routed_experts: bool = False,
        images=None,
    ) -> list[list[Sample]]:
        """Sample n_samples responses per prompt (rows prompt-major: prompt 0's n, then prompt 1's ...).
        ``images``: one ``ImageInputs`` or None per prompt (a vision-language model loaded ``multimodal``)."""
        out: list = [None] * len(prompt_ids)
        for i, group in self.generate_groups(prompt_ids, params, n_samples, return_routed_experts, images):
            out[i] = group
        return out

    @torch.no_grad()
    def generate_groups(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, n_samples: int = 1,
                        return_routed_experts: bool = False, images=None) -> Iterator[tuple[int, list[Sample]]]:
        """``generate`` handing back each prompt's group as soon as its n_samples rows have finished: yields
        (prompt index, group) in completion order (groups finishing at one decode step in index order). One batch,
        one generator: the samples are ``generate``'s, bit for bit, whatever the consumer does between groups.
        A pause (``pause_generation``) ends the batch: the groups not yet handed back come with their unfinished
        rows aborted."""
        self._check_ready()
        images = check_images(prompt_ids, images)
        if images is not None or self._vision_model() is not None:  # a VL model: placeholders need their images
            self._check_image_prompts(prompt_ids, images)
        prompts = [list(map(int, p)) for p in prompt_ids for _ in range(n_samples)]
        if not prompts:
            yield from ((i, []) for i in range(len(prompt_ids)))
            return
        row_images = [im for im in images for _ in range(n_samples)] if images is not None else None
        from megatron_s3ac.rollout.lengths import row_budgets

        # params.max_new_tokens for every row, or the designed per-response budgets (rollout/lengths.py)
        yield from self._iter_rows(prompts, params, row_budgets(params, prompts, n_samples), return_routed_experts,
                                   row_images, n_samples)

    # -- partial rollout (rollout/partial.py; docs/rollout.md "Partial rollout") --------------------
    supports_pause = True

    def pause_generation(self) -> None:
        """SGLang's ``/pause_generation`` in its default mode "abort" (sglang 0.5.23
        managers/tokenizer_manager.py:2267-2280, managers/scheduler.py:5675-5813): a running ``generate`` stops at
        its next decode step and returns every unfinished response with finish_reason "abort" and what it has
        (tokens, log-probs, routes of the tokens fed so far); one that starts while paused returns its responses
        empty and aborted (sglang: requests in the waiting queue are popped and aborted). Thread-safe: called while
        a ``generate`` runs (RemoteEngine's control thread)."""
        self._paused.set()

    def continue_generation(self) -> None:
        """SGLang's ``/continue_generation`` (managers/tokenizer_manager.py:2282-2286): generation runs again."""
        self._paused.clear()

    @torch.no_grad()
    def generate_continuations(self, requests: Sequence[tuple[Sequence[int], int]], params: SamplingParams,
                               return_routed_experts: bool = False, images=None) -> list[Sample]:
        """One sample per (prefix ids, budget) request: the prefix (prompt + partial response) is prefilled with the
        current weights and up to ``budget`` new tokens sampled; the sample's prompt_ids are the prefix, its
        response / log-probs / routes the new tokens only (routes: rows of the prefix too, recomputed now).
        ``images`` (one ImageInputs or None per request): the prompt's images, prefilled with the prefix as
        ``generate`` prefills an image prompt; a prefix holding image placeholders without its images is refused
        rather than served as text."""
        prefixes = [list(map(int, p)) for p, _ in requests]
        images = check_images(prefixes, images)
        if self._vision_model() is not None:
            image_id = int(self.model.config.image_token_id)
            for i, p in enumerate(prefixes):
                if (images is None or images[i] is None) and any(t == image_id for t in p):
                    raise ValueError(f"continuation {i} holds image tokens ({image_id}) but no images: partial "
                                     f"rollout of image prompts needs the prompt's images with the continuation")
        return self._generate_rows(prefixes, params, [int(b) for _, b in requests], return_routed_experts, images)

    def _generate_rows(self, prompts: list[list[int]], params: SamplingParams, budgets: list[int],
                       return_routed_experts: bool, row_images=None) -> list[Sample]:
        """One sample per row of ``prompts``, row b sampling at most ``budgets[b]`` tokens; ``row_images``: one
        ImageInputs or None per row (image prompts), or None."""
        out: list = [None] * len(prompts)
        for row, (s,) in self._iter_rows(prompts, params, budgets, return_routed_experts, row_images, 1):
            out[row] = s
        return out

    @torch.no_grad()
    def _iter_rows(self, prompts: list[list[int]], params: SamplingParams, budgets: list[int],
                   return_routed_experts: bool, row_images, group: int) -> Iterator[tuple[int, list[Sample]]]:
        """``_generate_rows`` as a generator over groups of ``group`` consecutive rows: yields (group index, its
        samples) as soon as every row of the group has finished (completion order), the rest at the end."""
        from transformers import DynamicCache

        self._check_ready()
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer; pass one to CPUEngine")
        if return_routed_experts and self._capture is None:
            raise ValueError("return_routed_experts: this model has no MoE router")
        if not prompts:
            return
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        if any(b < 1 for b in budgets):
            raise ValueError(f"every row needs a token budget >= 1, got {min(budgets)}")
        if self._paused.is_set():  # sglang: a waiting request is aborted before it runs (scheduler.py:5685-5705)
            aborted = [Sample(prompt_ids=p, response_ids=[], logprobs=np.zeros(0, np.float32), finish_reason="abort",
                           routed_experts=(np.zeros((len(p) - 1, self.num_layers, self.top_k), self.routes_dtype)
                                           if return_routed_experts else None),
                           response_text="" if self.tokenizer is not None else None,
                           images=row_images[r] if row_images is not None else None) for r, p in enumerate(prompts)]
            yield from ((g, aborted[g * group:(g + 1) * group]) for g in range(len(prompts) // group))
            return
        max_new = max(budgets)
        B, P = len(prompts), max(len(p) for p in prompts)
        lens = torch.tensor([len(p) for p in prompts])
        pads = P - lens
        input_ids = torch.full((B, P), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((B, P), dtype=torch.long)
        for b, p in enumerate(prompts):
            input_ids[b, P - len(p):] = torch.tensor(p)
            mask[b, P - len(p):] = 1
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        dev = self.device
        input_ids, mask, position_ids = input_ids.to(dev), mask.to(dev), position_ids.to(dev)
        vision, rope_delta = {}, None
        if row_images is not None:  # prefill inputs of an image batch: pixels, grids, 4-row mRoPE positions
            vision, position_ids, rope_delta = self._vision_inputs(input_ids, mask, position_ids, row_images)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        stop_ids_t = torch.tensor(sorted(stop_ids), dtype=torch.long, device=dev)
        generator = torch.Generator(device=dev).manual_seed(params.seed) if params.seed is not None else None

        tokens: list[list[int]] = [[] for _ in range(B)]
        logps: list[list[float]] = [[] for _ in range(B)]
        finish = [""] * B
        routes = None
        if return_routed_experts:
            rows = P + max_new - 1
            routes = torch.zeros((B, rows, self.num_layers, self.top_k), dtype=_torch_dtype(self.routes_dtype))
        if self._capture is not None:
            self._capture.enabled = return_routed_experts

        def sample(row: int) -> Sample:  # a finished row: its tokens, log-probs and routes are complete
            resp = tokens[row]
            return Sample(
                prompt_ids=prompts[row],
                response_ids=resp,
                logprobs=np.asarray(logps[row], dtype=np.float32),
                finish_reason=finish[row],
                routed_experts=(routes[row, : len(prompts[row]) + len(resp) - 1].numpy().astype(self.routes_dtype)
                                if routes is not None else None),
                response_text=(self.tokenizer.decode(resp, skip_special_tokens=True)
                               if self.tokenizer is not None else None),
                images=row_images[row] if row_images is not None else None,
            )

        yielded: set[int] = set()
        cache = DynamicCache(config=self.model.config)
        active = torch.arange(B)  # batch position -> sample row
        try:
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                             cache=cache, use_cache=True, logits_to_keep=1, **vision)
            if routes is not None:  # prefill: prompt token j of row b sits at padded position pads[b] + j
                for layer, ids in self._capture.pop().items():
                    ids = ids.view(B, P, self.top_k)
                    for b in range(B):
                        routes[b, : lens[b], layer] = ids[b, pads[b]:].to(routes.dtype)
            next_pos = position_ids[0, :, -1] if rope_delta is not None else position_ids[:, -1]
            for step in range(max_new):
                new, lp = sample_tokens(out.logits[:, -1].float(), params, generator)
                done = torch.zeros(len(active), dtype=torch.bool)
                new_l, lp_l = new.tolist(), lp.tolist()  # one device -> host copy per step
                for i, row in enumerate(active.tolist()):
                    tokens[row].append(new_l[i])
                    logps[row].append(lp_l[i])
                is_stop = torch.isin(new, stop_ids_t).cpu()
                for i, row in enumerate(active.tolist()):
                    if is_stop[i] or (params.stop_strings and self._hit_stop_string(tokens[row], params.stop_strings)):
                        finish[row], done[i] = "stop", True
                    elif len(tokens[row]) >= budgets[row]:
                        finish[row], done[i] = "length", True
                for g in sorted({row // group for i, row in enumerate(active.tolist()) if done[i]}):
                    if all(finish[r] for r in range(g * group, (g + 1) * group)):
                        yielded.add(g)
                        yield g, [sample(r) for r in range(g * group, (g + 1) * group)]
                if bool(done.all()):
                    break
                if self._paused.is_set():  # sglang's abort of a running request: it returns what it has
                    for i, row in enumerate(active.tolist()):
                        if not done[i]:
                            finish[row] = "abort"
                    break
                keep = (~done).nonzero()[:, 0]
                if len(keep) < len(active):  # drop finished rows from the batch and the cache
                    for layer_cache in cache.layers:  # reorder_cache: also on linear-attention layers
                        layer_cache.reorder_cache(keep)
                    kd = keep.to(dev)
                    active, new, mask, next_pos = active[keep], new[kd], mask[kd], next_pos[kd]
                    if rope_delta is not None:
                        rope_delta = rope_delta[kd]
                mask = torch.cat([mask, torch.ones((len(active), 1), dtype=mask.dtype, device=dev)], dim=1)
                next_pos = next_pos + 1
                if rope_delta is None:
                    step_pos = next_pos[:, None]
                else:  # [text; t; h; w]: a generated token is text, its three mRoPE positions equal
                    mpos = (next_pos + rope_delta)[None].expand(3, -1)
                    step_pos = torch.cat([next_pos[None], mpos])[:, :, None]
                out = self.model(input_ids=new[:, None], attention_mask=mask, position_ids=step_pos,
                                 cache=cache, use_cache=True, logits_to_keep=1)
                if self._decode_delay:
                    time.sleep(self._decode_delay)
                if routes is not None:  # the fed token is response token `step` at row lens + step
                    for layer, ids in self._capture.pop().items():
                        routes[active, lens[active] + step, layer] = ids.to(routes.dtype)
        finally:
            if self._capture is not None:
                self._capture.enabled = False
                self._capture.pop()

        for g in range(B // group):  # every row has finished (or was aborted) by now
            if g not in yielded:
                yield g, [sample(r) for r in range(g * group, (g + 1) * group)]

    # -- image prompts --------------------------------------------------------------------------
    def _vision_model(self):
        """The inner multimodal model (``get_rope_index``, ``visual``) or None for a text-only model."""
        inner = getattr(self.model, "model", None)
        return inner if inner is not None and hasattr(inner, "get_rope_index") and hasattr(inner, "visual") else None

    def _check_image_prompts(self, prompt_ids, images) -> None:
        """Refuse, naming the prompt, images the engine cannot serve: a text-only model, or placeholder tokens
        that do not match the images' grids."""
        inner = self._vision_model()
        if inner is None and images is None:
            return
        if inner is None:
            raise ValueError(f"image prompts given, but this engine holds {type(self.model).__name__}, a text-only "
                             f"model: load the vision-language checkpoint with multimodal=True "
                             f"(make_engine_factory(..., multimodal=True); s3ac-eval does it for image benchmarks)")
        cfg = self.model.config
        merge = int(cfg.vision_config.spatial_merge_size)
        image_id, video_id = int(cfg.image_token_id), getattr(cfg, "video_token_id", None)
        for i, (p, im) in enumerate(zip(prompt_ids, images or [None] * len(prompt_ids))):
            n = sum(1 for t in p if int(t) == image_id)
            if video_id is not None and any(int(t) == int(video_id) for t in p):
                raise ValueError(f"prompt {i} holds video tokens ({video_id}); the engine serves images only")
            want = 0 if im is None else im.num_image_tokens(merge)
            if n != want:
                raise ValueError(f"prompt {i} has {n} image tokens ({image_id}) but its images "
                                 f"{[] if im is None else im.image_grid_thw.tolist()} take {want}: the ids must "
                                 f"hold each image's placeholders, expanded as the processor does")

    def _vision_inputs(self, input_ids, mask, text_pos, row_images):
        """(prefill kwargs, position_ids [4, B, P] = text positions + 3-D mRoPE, rope delta [B]) of a left-padded
        batch whose rows have images (``row_images``: one ImageInputs or None per row)."""
        from megatron_s3ac.models.multimodal import concat

        inner = self._vision_model()
        cfg = self.model.config
        mm_types = (input_ids == int(cfg.image_token_id)).int()  # text 0, image 1 (the processor's mm_token_type_ids)
        have = [im for im in row_images if im is not None]
        batch = concat(have)
        grid = batch.image_grid_thw.to(self.device)
        vis_pos, delta = inner.get_rope_index(input_ids, mm_types, image_grid_thw=grid, attention_mask=mask)
        position_ids = torch.cat([text_pos[None], vis_pos.to(text_pos.dtype)])
        kwargs = dict(pixel_values=batch.pixel_values.to(self.device), image_grid_thw=grid, mm_token_type_ids=mm_types)
        return kwargs, position_ids, delta.reshape(-1).to(self.device)

    def _hit_stop_string(self, response: list[int], stop_strings: tuple[str, ...]) -> bool:
        # Decode only a tail window: a stop string that just appeared ends inside it. A token is at
        # least one byte, so len(stop) + 8 tokens cover it even with multi-byte characters split.
        window = max(len(s.encode()) for s in stop_strings) + 8
        tail = self.tokenizer.decode(response[-window:], skip_special_tokens=True)
        return any(s in tail for s in stop_strings)

    def shutdown(self) -> None:
        if self._capture is not None:
            self._capture.remove()


def _fp8_checkpoint(path: str) -> bool:
    """Whether ``path`` is an HF directory whose config.json declares block-FP8 weights."""
    import json
    import os

    cfg = os.path.join(path, "config.json")
    if not os.path.isfile(cfg):
        return False
    with open(cfg) as f:
        q = json.load(f).get("quantization_config") or {}
    return "fp8" in str(q.get("quant_method", ""))


def _from_fp8(cls, path: str, tokenizer, dtype, multimodal: bool, **kwargs) -> "CPUEngine":
    """An engine on a block-FP8 checkpoint (``s3ac-convert mcore-to-hf --dtype fp8`` / SGLang's layout):
    the model is built from the config without its quantization_config (so transformers does not swap
    in its FP8 linears, which need accelerate + a GPU), then every safetensors tensor goes through
    ``update_weights``, which dequantizes fp8 + scale pairs. A tensor the model needs but the checkpoint
    lacks leaves its parameter stale: ``generate`` then refuses, naming it."""
    import json
    import os

    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(path)
    qcfg = config.quantization_config
    block = qcfg.get("weight_block_size") if isinstance(qcfg, dict) else getattr(qcfg, "weight_block_size", None)
    if list(block or []) != [128, 128]:
        raise ValueError(f"{path}: fp8 checkpoint with weight_block_size {block}; the CPU engine reads [128, 128] blocks")
    del config.quantization_config
    model = _auto_class(multimodal).from_config(config, dtype=dtype, **kwargs)
    if os.path.exists(os.path.join(path, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(path)
    if tokenizer == "auto":
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError):
            tokenizer = None
    engine = cls(model, tokenizer=tokenizer)
    engine._stale = {n for n, _ in engine._unique_params()}  # filled as the checkpoint's tensors arrive
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    for fn in files:
        with safe_open(os.path.join(path, fn), framework="pt") as f:
            engine.update_weights((k, f.get_tensor(k)) for k in f.keys())
    return engine


def _auto_class(multimodal: bool):
    """transformers' auto class the engine loads: the causal LM (for a vision-language checkpoint, its
    text-only model), or with ``multimodal`` the image-text-to-text model (vision tower included)."""
    import transformers

    return transformers.AutoModelForImageTextToText if multimodal else transformers.AutoModelForCausalLM


def _as_torch_dtype(dtype) -> torch.dtype:
    """A torch dtype, or its name ("bfloat16", "torch.float32"), as a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    got = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(got, torch.dtype):
        raise ValueError(f"{dtype!r} is not a torch dtype")
    return got


def _torch_dtype(np_dtype: np.dtype) -> torch.dtype:
    return {np.dtype(np.uint8): torch.uint8, np.dtype(np.int16): torch.int16, np.dtype(np.int32): torch.int32}[np.dtype(np_dtype)]
