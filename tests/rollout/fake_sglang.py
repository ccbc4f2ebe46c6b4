"""A behavioural stand-in for sglang==0.5.23's ``sglang.Engine`` (GPU-only), on a real transformers model.

``FakeSGLangEngine(**server_args)`` is built like ``sglang.Engine(**server_args)``: it loads the HF checkpoint at
``model_path`` into a real torch model (transformers, through CPUEngine), so log-probs, routed experts and weights
are real. It reproduces the behaviours of the wheel that matter to the wrapper; each is cited as file:line
under ``sglang/srt/`` of sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl:

1. Weight-update sessions (managers/scheduler_components/weight_updater.py:309-335): ``begin_weight_update``
   twice -> (False, "a weight-update session is already open; ..."); ``end_weight_update`` without one ->
   (False, "no weight-update session is open; ..."); ``update_weights_from_tensor`` / ``_from_distributed``
   outside a session -> (False, "... must run between begin_weight_update() and end_weight_update()") and load
   nothing (weight_updater.py:187-197, 232-240). All of them return ``(success, message)`` tuples
   (managers/tokenizer_control_mixin.py:445-601).
2. The Qwen3-MoE loader skips names it does not know (no error, success stays True): models/qwen3_moe.py:1222-1225,
   1244-1246, 1264-1267. A known name with the wrong shape fails its weight_loader; on the tensor path nothing
   catches it and the scheduler dies (weight_updater.py:343-381, scheduler.py:6370-6373); on the distributed path
   it becomes (False, "Failed to update parameter online: ...") (weight_updater.py:324-341).
3. ``flush_cache()`` -> FlushCacheReqOutput(success=False) while requests are running or queued
   (managers/scheduler.py:5518-5543; io_struct.py:1859-1861). ``flush_cache=True`` on an update call that finds
   the engine busy turns it into (False, "Weights were updated, but the cache was not flushed ...")
   (weight_updater.py:120-133). Busy is modelled by ``busy_flushes``: that many next flushes find requests running.
4. Memory tags (weight_updater.py:337-422): release adds tags to ``offload_tags`` (None/[] -> all three,
   constants.py:6-10) and asserts the engine is idle; resume does ``offload_tags.remove(tag)``: KeyError for a tag
   not released, which kills the scheduler (scheduler.py:6370-6373) -> this stand-in is dead afterwards.
   Weights released without ``enable_weights_cpu_backup`` come back as garbage (torch_memory_saver frees them);
   here they come back as NaN.
5. Aborted requests (``abort_requests``: request positions of the next generate call, ``abort_after`` tokens
   generated first): meta_info = id, finish_reason {"type": "abort", "message": "Abort in waiting queue"},
   the log-probs of the tokens so far, and NO ``routed_experts`` (managers/tokenizer_manager.py:3596-3635).
6. Seeds (sampling/sampling_batch_info.py:157-171): with ``enable_deterministic_inference`` a request without
   ``sampling_seed`` samples with 42; without it every seed is ignored (the engine's own RNG, from random_seed).
7. Context length (tokenizer_manager.py:1333-1375, checked per request before any is sent, 1711): prompt
   >= context -> ValueError("The input (N tokens) is longer than the model's context length (C tokens)."),
   prompt + max_new_tokens > context -> ValueError("Requested token count exceeds the model's maximum context
   length ..."): the whole batch raises. Context = ``context_length`` or the config's max_position_embeddings
   (utils/hf_transformers/common.py:668-694).
8. Qwen3-MoE makes every layer sparse (models/qwen3_moe.py:878): ``mlp_only_layers`` / ``decoder_sparse_step``
   are ignored, so a checkpoint's dense-MLP tensors are silently skipped (experts stay uninitialised).
9. ``init_weights_update_group`` joins a torch.distributed group as rank ``rank_offset + tp_rank`` (blocking
   until all members join), ``update_weights_from_distributed`` receives with ``broadcast(src=0)``, one
   broadcast per tensor, or one flat uint8 broadcast per bucket with load_format="flattened_bucket"
   (model_executor/model_runner_components/weight_updater.py:100-144, 260-310; weight_sync/tensor_bucket.py:86-112).
   ``update_weights_from_tensor(load_format="flattened_bucket")`` takes one payload per TP rank, each a
   {"flattened_tensor", "metadata"} bucket (weight_updater.py:383-413; entrypoints/engine.py:1743-1759); the CUDA
   IPC handle of a real payload is modelled by the bucket itself.

Hooks for tests (not part of sglang's API, prefixed ``debug_``): read the served tensors back under their
checkpoint names. ``calls`` records every Engine call in order.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import numpy as np
import torch

from megatron_s3ac.rollout.base import SamplingParams

ALL_TAGS = ["kv_cache", "weights", "cuda_graph"]  # constants.py:6-10
SESSION_REQUIRED = "{} must run between begin_weight_update() and end_weight_update()"


@dataclasses.dataclass
class FlushCacheReqOutput:  # io_struct.py:1859-1861
    success: bool
    message: str = ""


class SchedulerDied(RuntimeError):
    """The engine's scheduler hit an exception; sglang then SIGQUITs the engine (scheduler.py:6370-6373)."""


def _checkpoint_names(model) -> dict[str, tuple[int, ...]]:
    from transformers.core_model_loading import revert_weight_conversion

    sd = revert_weight_conversion(model, dict(model.state_dict()))
    return {k: tuple(v.shape) for k, v in sd.items()}


class FakeSGLangEngine:
    # Test-only hooks, excluded from the signature contract check.
    TEST_HOOKS = ("debug_checkpoint_tensor", "debug_checkpoint_state_dict")

    def __init__(self, model_path: str, tp_size: int = 1, context_length: Optional[int] = None,
                 enable_return_routed_experts: bool = False, enable_memory_saver: bool = False,
                 enable_weights_cpu_backup: bool = False, enable_deterministic_inference: bool = False,
                 random_seed: Optional[int] = None, skip_tokenizer_init: bool = False, **other_server_args):
        from transformers import AutoConfig
        from safetensors.torch import load_file

        from megatron_s3ac.rollout.cpu_engine import CPUEngine

        self.server_args = dict(model_path=model_path, tp_size=tp_size, **other_server_args)
        self.tp_size = tp_size
        self.deterministic = enable_deterministic_inference
        self.return_routes = enable_return_routed_experts
        self.memory_saver = enable_memory_saver
        self.cpu_backup = enable_weights_cpu_backup
        self.calls: list = []
        self.offload_tags: set = set()
        self.session: Optional[dict] = None
        self.busy_flushes = 0
        self.abort_requests: set = set()
        self.abort_after = 1
        self.dead: Optional[str] = None
        self._groups: dict = {}
        self._rng = np.random.default_rng(random_seed)
        config = AutoConfig.from_pretrained(model_path)
        if getattr(config, "model_type", None) == "qwen3_moe":  # qwen3_moe.py:878: every layer sparse
            config.mlp_only_layers, config.decoder_sparse_step = [], 1
        self.cpu = CPUEngine.from_config(config, seed=int(random_seed or 0))
        self.served = _checkpoint_names(self.cpu.model)
        self.context_len = int(context_length or config.max_position_embeddings)
        files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
        for f in files:  # initial load goes through the same (silently skipping) loader
            self._load(list(load_file(os.path.join(model_path, f)).items()))

    # -- helpers --------------------------------------------------------------------------------
    def _alive(self, method):
        self.calls.append(method)
        if self.dead:
            raise SchedulerDied(f"sglang engine is dead ({self.dead}); {method} cannot be served")

    def _die(self, why: str):
        self.dead = why
        raise SchedulerDied(why)

    def _load(self, named, crash_on_error: bool = True):
        """qwen3_moe.py load_weights: unknown names skipped silently; a wrong shape fails the loader."""
        for name, tensor in named:
            if name not in self.served:
                continue  # qwen3_moe.py:1224-1225 / 1266-1267
            if tuple(tensor.shape) != self.served[name]:
                raise AssertionError(f"weight_loader: shape {tuple(tensor.shape)} != {self.served[name]} for {name}")
            self.cpu.update_weights([(name, tensor.to(torch.float32))])

    def _flush(self) -> bool:
        if self.busy_flushes > 0:  # scheduler.py:5520 is_fully_idle() is False
            self.busy_flushes -= 1
            return False
        return True

    def _after_update(self, flush_cache: bool, source: str) -> tuple[bool, str]:
        self.session["loaded_weights"] = True
        if flush_cache and not self._flush():  # weight_updater.py:120-133
            return False, ("Weights were updated, but the cache was not flushed because requests are still running "
                           "or queued. Retract or finish them, then call /flush_cache.")
        return True, "Success" if source == "tensor" else "Succeeded to update parameter online."

    # -- Engine API (signatures as entrypoints/engine.py) ---------------------------------------
    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                 return_routed_experts=False, **kwargs):
        self._alive("generate")
        if self.offload_tags & {"weights", "kv_cache"}:
            self._die(f"generate with released memory {sorted(self.offload_tags)} (illegal memory access)")
        single = input_ids and isinstance(input_ids[0], int)
        batch = [input_ids] if single else list(input_ids)
        sps = sampling_params if isinstance(sampling_params, list) else [dict(sampling_params or {})] * len(batch)
        for ids, sp in zip(batch, sps):  # tokenizer_manager.py:1338-1375, all before any request runs
            n = len(ids)
            if n >= self.context_len:
                raise ValueError(f"The input ({n} tokens) is longer than the model's context length "
                                 f"({self.context_len} tokens).")
            m = sp.get("max_new_tokens")
            if m is not None and m + n > self.context_len:
                raise ValueError(f"Requested token count exceeds the model's maximum context length of "
                                 f"{self.context_len} tokens. You requested a total of {m + n} tokens: {n} tokens "
                                 f"from the input messages and {m} tokens for the completion. Please reduce the "
                                 f"number of tokens in the input messages or the completion to fit within the limit.")
        aborts, self.abort_requests = set(self.abort_requests), set()
        outputs = []
        for i, (ids, sp) in enumerate(zip(batch, sps)):
            seed = sp.get("sampling_seed")
            if self.deterministic:
                seed = 42 if seed is None else int(seed)  # sampling_batch_info.py:157-171
            else:
                seed = int(self._rng.integers(0, 2**62))  # seeds ignored without deterministic inference
            params = SamplingParams(temperature=sp.get("temperature", 1.0), top_p=sp.get("top_p", 1.0),
                                    top_k=sp.get("top_k", -1), max_new_tokens=sp.get("max_new_tokens", 128),
                                    stop_token_ids=sp.get("stop_token_ids") or (), seed=seed,
                                    ignore_eos=sp.get("ignore_eos", False))
            s = self.cpu.generate([ids], params, 1, bool(return_routed_experts and self.return_routes))[0][0]
            rid = f"req-{len(self.calls)}-{i}"
            if i in aborts:
                n = min(self.abort_after, len(s.response_ids))
                meta = {"id": rid, "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                        "completion_tokens": n}
                if return_logprob:
                    meta["output_token_logprobs"] = [(float(lp), int(t), None)
                                                     for lp, t in zip(s.logprobs[:n], s.response_ids[:n])]
                outputs.append({"text": None, "output_ids": list(s.response_ids[:n]), "meta_info": meta})
                continue
            meta = {"id": rid, "finish_reason": {"type": s.finish_reason}, "prompt_tokens": len(ids),
                    "completion_tokens": len(s.response_ids)}
            if return_logprob:
                meta["output_token_logprobs"] = [(float(lp), int(t), None) for lp, t in zip(s.logprobs, s.response_ids)]
            if return_routed_experts and self.return_routes:
                import base64
                meta["routed_experts"] = base64.b64encode(s.routed_experts.astype("<i4").tobytes()).decode()
            outputs.append({"text": None, "output_ids": list(s.response_ids), "meta_info": meta})
        return outputs[0] if single else outputs

    def begin_weight_update(self, selector: str = "all"):
        self._alive("begin_weight_update")
        if self.session is not None:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session = {"selector": selector, "loaded_weights": False}
        return True, "Success"

    def end_weight_update(self):
        self._alive("end_weight_update")
        if self.session is None:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = None
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self._alive("update_weights_from_tensor")
        if self.session is None:
            return False, SESSION_REQUIRED.format("update_weights_from_tensor")
        if self.offload_tags & {"weights"}:
            self._die("update_weights_from_tensor into released weights (illegal memory access)")
        if load_format == "flattened_bucket":
            if len(named_tensors) != self.tp_size:
                self._die(f"{len(named_tensors)} flattened payloads for tp_size={self.tp_size}")
            named = _reconstruct(named_tensors[0])  # TP rank 0's payload (each rank reads its own)
        elif load_format is None:
            named = list(named_tensors)
        else:
            self._die(f"NotImplementedError: Unknown load_format={load_format}")
        try:
            self._load(named)
        except AssertionError as err:  # uncaught on the tensor path: the scheduler dies
            self._die(f"Scheduler hit an exception: {err}")
        return self._after_update(flush_cache, "tensor")

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                  backend="nccl"):
        self._alive("init_weights_update_group")
        from megatron_s3ac.rollout.broadcast import init_custom_process_group

        if self.tp_size != 1:
            raise NotImplementedError("the stand-in joins broadcast groups with tp_size=1 only")
        try:
            self._groups[group_name] = init_custom_process_group(
                backend="gloo" if backend == "nccl" and not torch.cuda.is_available() else backend,
                init_method=f"tcp://{master_address}:{master_port}", world_size=world_size,
                rank=rank_offset + 0, group_name=group_name)
            return True, "Succeeded to initialize custom process group."
        except Exception as e:
            return False, f"Failed to initialize custom process group: {e}."

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        flush_cache=True, load_format=None):
        self._alive("update_weights_from_distributed")
        if self.session is None:
            return False, SESSION_REQUIRED.format("update_weights_from_distributed")
        if group_name not in self._groups:
            self._die(f"Group {group_name} not in {list(self._groups)}. Please call `init_weights_update_group` first.")
        group = self._groups[group_name]
        try:
            dts = [getattr(torch, d) if isinstance(d, str) else d for d in dtypes]
            if load_format == "flattened_bucket":
                sizes = [int(np.prod(s)) * dt.itemsize for s, dt in zip(shapes, dts)]
                flat = torch.empty(sum(sizes), dtype=torch.uint8)
                torch.distributed.broadcast(flat, src=0, group=group)
                weights, at = [], 0
                for n, s, dt, size in zip(names, shapes, dts, sizes):
                    weights.append((n, flat[at:at + size].view(dt).view(s)))
                    at += size
            else:
                weights = []
                for n, s, dt in zip(names, shapes, dts):
                    w = torch.empty(s, dtype=dt)
                    torch.distributed.broadcast(w, src=0, group=group)
                    weights.append((n, w))
        except Exception as e:
            return False, f"Failed to receive weights: {e}"
        try:
            self._load(weights)
        except Exception as e:  # weight_updater.py:324-341
            return False, (f"Failed to update parameter online: {e}. The full weights of the ModelRunner are "
                           f"partially updated. Please discard the whole weights.")
        return self._after_update(flush_cache, "distributed")

    def destroy_weights_update_group(self, group_name):
        self._alive("destroy_weights_update_group")
        if group_name not in self._groups:
            return False, "The group to be destroyed does not exist."
        torch.distributed.destroy_process_group(self._groups.pop(group_name))
        return True, "Succeeded to destroy custom process group."

    def release_memory_occupation(self, tags=None):
        self._alive("release_memory_occupation")
        if not self._flush_idle():
            self._die("AssertionError: release_memory_occupation should be called only when server is idle.")
        tags = list(tags) if tags else list(ALL_TAGS)
        self.offload_tags.update(tags)
        if "weights" in tags:
            self._stash = {k: v.detach().clone() for k, v in self.cpu.model.state_dict().items()} \
                if self.cpu_backup else None
            with torch.no_grad():
                for p in self.cpu.model.parameters():
                    p.fill_(float("nan"))  # the memory is given back; its content is gone
        return None

    def resume_memory_occupation(self, tags=None):
        self._alive("resume_memory_occupation")
        tags = list(tags) if tags else list(ALL_TAGS)
        for tag in tags:
            try:
                self.offload_tags.remove(tag)  # weight_updater.py:389-390
            except KeyError:
                self.dead = f"Scheduler hit an exception: KeyError: {tag!r}"
                raise
        if "weights" in tags and getattr(self, "_stash", None) is not None:
            self.cpu.model.load_state_dict(self._stash)
            self._stash = None
        return None

    def flush_cache(self):
        self._alive("flush_cache")
        return FlushCacheReqOutput(success=self._flush())

    def shutdown(self):
        self.calls.append("shutdown")
        for g in list(self._groups.values()):
            torch.distributed.destroy_process_group(g)
        self._groups.clear()

    def _flush_idle(self) -> bool:
        return self.busy_flushes == 0

    # -- test hooks -----------------------------------------------------------------------------
    def debug_checkpoint_state_dict(self) -> dict:
        """The served weights under checkpoint names (what a sync must have written)."""
        from transformers.core_model_loading import revert_weight_conversion

        return revert_weight_conversion(self.cpu.model, dict(self.cpu.model.state_dict()))

    def debug_checkpoint_tensor(self, name: str) -> torch.Tensor:
        return self.debug_checkpoint_state_dict()[name]


def _reconstruct(payload) -> list:
    """tensor_bucket.py:118-140: views of the flat tensor by metadata."""
    flat, out = payload["flattened_tensor"], []
    for m in payload["metadata"]:
        out.append((m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)))
    return out


def save_tiny_qwen3_moe(path, seed: int = 0, **overrides) -> str:
    """A tiny random Qwen3-MoE HF checkpoint (no dense layers: servable by sglang) saved at path."""
    from transformers import AutoModelForCausalLM

    from rollout_fixtures import tiny_moe_config

    torch.manual_seed(seed)
    cfg = tiny_moe_config(**{"mlp_only_layers": [], **overrides})
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(path))
    return str(path)
