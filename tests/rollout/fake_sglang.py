"""A behavioural stand-in for sglang==0.5.23's ``sglang.Engine`` (GPU-only), on a real transformers model.

``FakeSGLangEngine(**server_args)`` is built like ``sglang.Engine(**server_args)``: it loads the HF checkpoint at
``model_path`` into a real torch model (transformers, through CPUEngine), so log-probs, routed experts and weights
are real. It reproduces the behaviours of the wheel that matter to the wrapper; each is cited as file:line
under ``sglang/srt/`` of sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl:

1. Weight-update sessions (managers/scheduler_components/weight_updater.py:309-335): ``begin_weight_update``
   twice -> (False, "a weight-update session is already open; ..."); ``end_weight_update`` without one ->
   (False, "no weight-update session is open; ..."); ``update_weights_from_tensor`` / ``_from_distributed``
   outside a session -> (False, "... must run between begin_weight_update() and end_weight_update()") and load
   nothing (managers/scheduler_components/weight_updater.py:187-197, 232-239). All of them return
   ``(success, message)`` tuples
   (managers/tokenizer_control_mixin.py:445-601).
2. The Qwen3-MoE loader skips names it does not know (no error, success stays True): models/qwen3_moe.py:1222-1225,
   1244-1246, 1264-1267; the Qwen3.5-MoE (VL) loader takes the routed experts fused (``mlp.experts.gate_up_proj`` /
   ``down_proj``, as transformers 5 saves them) or per expert, per-expert ones not after a fused one in the same
   call, and only logs an unknown name (models/qwen3_5.py:2659-2970; see ``_load``). A known name with the wrong
   shape fails its weight_loader; on the tensor path nothing catches it
   (managers/scheduler_components/weight_updater.py:232-263 calls
   model_executor/model_runner_components/weight_updater.py:343-413, neither has a try) and the scheduler dies
   (managers/scheduler.py:6370-6373); on the distributed path it becomes (False, "Failed to update parameter
   online: ...") (model_executor/model_runner_components/weight_updater.py:324-341).
3. ``flush_cache()`` -> FlushCacheReqOutput(success=False) while requests are running or queued
   (managers/scheduler.py:5518-5547; managers/io_struct.py:1859-1861). ``flush_cache=True`` on an update call that
   finds the engine busy turns it into (False, "Weights were updated, but the cache was not flushed ...")
   (managers/scheduler_components/weight_updater.py:120-133). Busy is modelled by ``busy_flushes``: that many next
   flushes find requests running.
4. Memory tags (managers/scheduler_components/weight_updater.py:337-422): release adds tags to ``offload_tags``
   (None/[] -> all three, 345-346; constants.py:6-10) and asserts the engine is idle (339-341); resume with
   None/[] also means all three (386-387) and does ``offload_tags.remove(tag)`` (389-390): KeyError for a tag
   not released, which kills the scheduler (managers/scheduler.py:6370-6373) -> this stand-in is dead afterwards.
   Weights released without ``enable_weights_cpu_backup`` come back as garbage (torch_memory_saver frees them);
   here they come back as NaN. All of them: the "weights" region is one ``memory_saver_adapter.region`` around
   the whole ``loader.load_model`` (model_executor/model_runner_components/load_model_utils.py:323-348), a VL
   model's vision tower included (built in the model's ``__init__``, models/qwen3_vl.py:1332-1340, the base of
   Qwen3_5MoeForConditionalGeneration, models/qwen3_5.py:2586); only buffers are stashed and put back
   (weight_updater.py:368-374, 395-402, 478-490), which the stand-in gets by leaving buffers alone. With the backup
   (load_model_utils.py:307-326; no per-module form) every parameter comes back as it was.
5. Aborted requests (``abort_requests``: request positions of the next generate call, ``abort_after`` tokens
   generated first): meta_info = id, finish_reason {"type": "abort", "message": "Abort in waiting queue"},
   the log-probs of the tokens so far, and NO ``routed_experts`` (managers/tokenizer_manager.py:3596-3635).
10. Pause / continue. The HTTP server's /pause_generation and /continue_generation (entrypoints/http_server.py:
   1831-1854) only await two coroutines of the engine's ``TokenizerManager``, which ``sglang.Engine`` holds as
   ``self.tokenizer_manager`` (entrypoints/engine.py:343) beside its event loop ``self.loop``
   (``_ensure_event_loop``, engine.py:396, 1404-1414); ``Engine.generate`` drives that loop itself,
   ``self.loop.run_until_complete(generator.__anext__())`` (engine.py:528-542), so the loop runs (and serves a
   coroutine another thread hands it with ``asyncio.run_coroutine_threadsafe``) only while a generate blocks in
   it. The stand-in has the same shape: ``tokenizer_manager`` (``FakeTokenizerManager``) and ``loop``; its
   ``generate`` runs ``tokenizer_manager.generate_request`` on ``loop`` (the CPU work in an executor thread, so
   the loop keeps serving). ``generate_request`` waits while ``is_pause`` (tokenizer_manager.py:938-939), then
   holds ``model_update_lock.reader_lock`` for the whole batch (941). ``pause_generation(obj)`` with
   ``obj.mode == "abort"`` (the default, managers/io_struct.py:1927-1946) takes ``is_pause_cond``, sets
   ``is_pause`` (tokenizer_manager.py:2267-2269), then loops ``abort_request(abort_all=True)``; ``await
   model_update_lock.is_locked()``; ``await asyncio.sleep(1.0)`` until no generate holds the lock (2273-2280):
   so it returns only after the aborted batch has come back, at least one second after it started when a batch
   was running. An aborted running request gets ``to_finish = FINISH_ABORT()`` (managers/scheduler.py:5797-5813),
   still runs one decode step and returns through the normal output path: its output_ids and log-probs so far,
   routed_experts when asked (tokenizer_manager.py:2602-2609), finish_reason {"type": "abort", "message":
   "Aborted", "status_code": None, "err_type": None} (managers/schedule_batch.py:332-345); a request still in the
   waiting queue is popped and aborted as in 5 (managers/scheduler.py:5685-5705). ``continue_generation(obj)``
   clears ``is_pause`` and wakes the waiting requests (tokenizer_manager.py:2282-2286). The stand-in runs a
   batch's requests one after another, so one is running (through CPUEngine's pause) and the later ones are
   waiting; modes retract / in_place are not modelled (refused).
6. Seeds (sampling/sampling_batch_info.py:157-171): with ``enable_deterministic_inference`` a request without
   ``sampling_seed`` samples with 42; without it every seed is ignored (the engine's own RNG, from random_seed).
   A seed that is not a plain int in [-2**63, 2**63 - 1] (e.g. numpy's int64) fails the whole batch with ValueError
   (sampling/sampling_params.py:302-312).
7. Context length (managers/tokenizer_manager.py:1307-1378, ``_validate_one_request``): prompt >= context ->
   ValueError("The input (N tokens) is longer than the model's context length (C tokens).") (1338-1351),
   prompt + max_new_tokens > context -> ValueError("Requested token count exceeds the model's maximum context
   length ...") (1353-1378): the ``generate`` call raises. Whether requests before the long one already ran
   depends on the path ``_handle_batch_request`` takes (2084-2114, chosen by ``_should_use_batch_tokenization``,
   1753-1767): without attention DP, pre-tokenized ``input_ids`` take the batch path, where every request is
   validated (1689 -> 1271; 1711 for text with enable_tokenizer_batch_encode) before any is sent (2087), so
   nothing runs; WITH attention DP (``attn_dp_enabled``) they take the sequential path (2098-2113), where each
   request is validated and sent in turn, so the requests before the long one are already in the scheduler when
   the ValueError is raised. The stand-in models the batch path only (it validates every request before any
   runs). This does not matter to SGLangEngine: ``_check_lengths`` refuses the batch (PromptTooLongError) before
   sglang is called whenever the context length is known (``context_length`` or the checkpoint's config).
   Context = ``context_length`` or the config's max_position_embeddings (utils/hf_transformers/common.py:668-694).
8. Qwen3-MoE makes every layer sparse (models/qwen3_moe.py:878): ``mlp_only_layers`` / ``decoder_sparse_step``
   are ignored, so a checkpoint's dense-MLP tensors are silently skipped (experts stay uninitialised).
9. ``init_weights_update_group`` joins a torch.distributed group as rank ``rank_offset + tp_rank`` (blocking
   until all members join), ``update_weights_from_distributed`` receives with ``broadcast(src=0)``, one
   broadcast per tensor, or one flat uint8 broadcast per bucket with load_format="flattened_bucket"
   (model_executor/model_runner_components/weight_updater.py:100-144, 260-310; weight_sync/tensor_bucket.py:86-112).
   ``update_weights_from_tensor(named_tensors=payloads, load_format="flattened_bucket")``:
   a. In the caller (entrypoints/engine.py:1743-1759 -> utils/common.py:3109-3131): each payload is normalized to
      bytes: a str is base64-decoded, bytes-like is kept (base64-decoded if it does not start like a pickle),
      anything else raises TypeError("serialized_named_tensors entries must be base64 strings or bytes-like
      payloads, got <type>") to the caller; nothing reached the scheduler, the engine stays alive.
   b. Session / released-weights checks as in 1 and 4 (managers/scheduler_components/weight_updater.py:232-239).
   c. Each TP rank r takes ``payloads[r]`` (managers/tp_worker.py:194-201: too few -> IndexError in that rank's
      scheduler -> dead) and deserializes it with ``SafeUnpickler`` (utils/common.py:3144-3372, modelled by
      ``SafeUnpicklerModel`` below: any global outside the allowlist -> RuntimeError("Blocked unsafe global
      (<module>.<name>) during pickle deserialization") -> dead), then reconstructs the tensors from the
      ``flattened_tensor`` and each metadata entry's six attributes
      (model_executor/model_runner_components/weight_updater.py:383-413, weight_sync/tensor_bucket.py:118-135).
      TP rank 0's tensors are loaded as in 2. Real TP ranks each narrow their own shard from their own payload, so
      a rank whose tensors differ from rank 0's would serve an inconsistent shard without an error: the stand-in
      records it (``debug_payload_log``) instead of failing.
      The payloads are real handles: on CPU, ForkingPickler with the ``file_system`` strategy names a shared-memory
      segment ``/torch_<producer pid>_...`` that this process maps (the counterpart of a CUDA IPC handle); the
      producer pid parsed from it is logged per bucket and TP rank. References to the deserialized tensors are
      dropped after loading (the producer's segment refcount).
10. How a scheduler death reaches the caller DIFFERS from sglang: the stand-in raises a Python exception in the
   caller (``SchedulerDied``; the KeyError itself for an unreleased tag) and refuses every later call. Real sglang
   never returns: the dying scheduler process sends SIGQUIT to its parent (managers/scheduler.py:6370-6373), whose
   handler (entrypoints/engine.py:1976-1982 at launch, replaced by managers/tokenizer_manager.py:2457-2459 ->
   4072-4081 once the event loop runs) calls ``kill_process_tree(os.getpid())`` (utils/common.py:2507-2553), which
   SIGKILLs the process holding the ``sglang.Engine``: no exception, no Python traceback, no ``finally``. In the
   trainer that is rank 0 itself for an in-process engine (colocated, ``rollout.sglang.num_engines: 1``), or the
   engine's Ray actor in a pool (the pool reports ``EngineDied``).

11. Image prompts (``image_data``, one entry per request: None or a list of images; managers/io_struct.py:194-200,
   645-678): the stand-in takes the pre-processed form only, ``[{"format": "processor_output", "pixel_values",
   "image_grid_thw"}]`` (base_processor.py:1060-1085), exactly one such dict per request (else ValueError, 1225-1236),
   the token ids kept as given (1293-1304); raw images (paths, bytes, PIL) would need sglang's processor run on the
   decoded ids (1307-1309), which the stand-in does not model: it refuses them. A VL checkpoint
   (``vision_config`` in its config) is served as the full model unless ``enable_multimodal=False``
   (configs/model_config.py:690-717); image data for a model served without it is refused. Generation runs the
   CPU engine's VL path; ``routed_experts`` has a row per prompt position, image placeholders included
   (managers/scheduler_components/batch_result_processor.py:149-162).

Hooks for tests (not part of sglang's API, prefixed ``debug_``): read the served tensors back under their
checkpoint names; ``debug_payload_log`` (one dict per flattened bucket: bucket, names, and per TP rank
``producers`` (the pid in its payload's segment name, None if none) and ``matches_rank0`` (its tensors equal rank
0's)). ``calls`` records every Engine call in order.
"""
from __future__ import annotations

import binascii
import base64
import dataclasses
import io
import os
import pickle
import re
from typing import Optional

import numpy as np
import torch

from megatron_s3ac.rollout.base import SamplingParams

ALL_TAGS = ["kv_cache", "weights", "cuda_graph"]  # constants.py:6-10
SESSION_REQUIRED = "{} must run between begin_weight_update() and end_weight_update()"


_FUSED_EXPERTS = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.")


@dataclasses.dataclass
class FlushCacheReqOutput:  # io_struct.py:1859-1861
    success: bool
    message: str = ""


class SchedulerDied(RuntimeError):
    """The engine's scheduler hit an exception. Real sglang raises nothing: the scheduler SIGQUITs its parent
    (managers/scheduler.py:6370-6373), whose handler kills the whole process (item 10 of the module docstring)."""


def _checkpoint_names(model) -> dict[str, tuple[int, ...]]:
    from transformers.core_model_loading import revert_weight_conversion

    sd = revert_weight_conversion(model, dict(model.state_dict()))
    return {k: tuple(v.shape) for k, v in sd.items()}


class _ReaderCountLock:
    """utils/aio_rwlock.py's RWLock as generate_request and pause use it: ``reader_lock`` (an async context
    manager) and ``is_locked()`` (``_readers`` > 0; aio_rwlock.py:13, 78-80)."""

    def __init__(self):
        self._readers = 0

    @property
    def reader_lock(self):
        import contextlib

        @contextlib.asynccontextmanager
        async def held():
            self._readers += 1
            try:
                yield
            finally:
                self._readers -= 1

        return held()

    async def is_locked(self) -> bool:
        return self._readers > 0


class FakeTokenizerManager:
    """managers/tokenizer_manager.py's pause / continue and the part of ``generate_request`` they interact with
    (module docstring item 10). Its asyncio primitives are used on the engine's ``loop`` only."""

    PAUSE_POLL_S = 1.0  # tokenizer_manager.py:2280 ``await asyncio.sleep(1.0)``

    def __init__(self, engine: "FakeSGLangEngine"):
        self.engine = engine
        self.is_pause = False  # tokenizer_manager.py:777
        self._cond = None  # asyncio.Condition() (778), made on the loop at first use
        self.model_update_lock = _ReaderCountLock()  # 771
        self.pause_calls = 0

    @property
    def is_pause_cond(self):
        import asyncio

        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def generate_request(self, run_batch):
        import asyncio

        async with self.is_pause_cond:  # tokenizer_manager.py:938-939
            await self.is_pause_cond.wait_for(lambda: not self.is_pause)
        async with self.model_update_lock.reader_lock:  # 941: held until the batch's outputs are back
            return await asyncio.get_running_loop().run_in_executor(None, run_batch)

    def abort_request(self, rid: str = "", abort_all: bool = False):
        """abort_all: the scheduler aborts every running and waiting request (tokenizer_manager.py:2241-2265;
        managers/scheduler.py:5685-5705, 5797-5813): the stand-in's running request stops at its next decode step."""
        if abort_all:
            self.engine.cpu.pause_generation()

    async def pause_generation(self, obj):
        import asyncio

        self.engine._alive("pause_generation")
        if obj.mode not in ("abort", "retract", "in_place"):  # io_struct.py:1946 Literal
            raise ValueError(f"mode must be one of abort, retract, in_place, got {obj.mode!r}")
        if obj.mode != "abort":
            raise NotImplementedError(f"the stand-in models pause mode 'abort' only, not {obj.mode!r}")
        self.pause_calls += 1
        async with self.is_pause_cond:  # tokenizer_manager.py:2267-2280
            self.is_pause = True
            while True:
                self.abort_request(abort_all=True)
                if not await self.model_update_lock.is_locked():
                    break
                await asyncio.sleep(self.PAUSE_POLL_S)

    async def continue_generation(self, obj):
        self.engine._alive("continue_generation")
        async with self.is_pause_cond:  # tokenizer_manager.py:2282-2286
            self.is_pause = False
            self.engine.cpu.continue_generation()
            self.is_pause_cond.notify_all()


class FakeSGLangEngine:
    # Test-only hooks, excluded from the signature contract check.
    TEST_HOOKS = ("debug_checkpoint_tensor", "debug_checkpoint_state_dict", "debug_payload_log",
                  "debug_crash_scheduler_at_forward")

    def __init__(self, model_path: str, tp_size: int = 1, context_length: Optional[int] = None,
                 enable_return_routed_experts: bool = False, enable_memory_saver: bool = False,
                 enable_weights_cpu_backup: bool = False, enable_deterministic_inference: bool = False,
                 random_seed: Optional[int] = None, skip_tokenizer_init: bool = False,
                 enable_multimodal: Optional[bool] = None, **other_server_args):
        from transformers import AutoConfig
        from safetensors.torch import load_file

        from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine

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
        self.debug_payload_log: list[dict] = []
        self._flat_buckets = 0
        self._rng = np.random.default_rng(random_seed)
        import asyncio

        self.tokenizer_manager = FakeTokenizerManager(self)  # item 10 (entrypoints/engine.py:343)
        self.loop = asyncio.new_event_loop()  # engine.py:396, 1404-1414 (a fresh loop where none is set)
        config = AutoConfig.from_pretrained(model_path)
        if getattr(config, "model_type", None) == "qwen3_moe":  # qwen3_moe.py:878: every layer sparse
            config.mlp_only_layers, config.decoder_sparse_step = [], 1
        # model_config.py:690-717: multimodal unless disabled (the architectures listed there are not ours)
        self.multimodal = getattr(config, "vision_config", None) is not None and enable_multimodal is not False
        self.cpu = CPUEngine.from_config(config, seed=int(random_seed or 0), multimodal=self.multimodal)
        self.served = _checkpoint_names(self.cpu.model)
        # models/qwen3_5.py (Qwen3_5MoeForConditionalGeneration.load_weights, 2659-2970): besides the per-expert
        # names (FusedMoE.make_expert_params_mapping, layers/moe/fused_moe_triton/layer.py:1797-1823) it takes
        # transformers 5's fused ``mlp.experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I] (2703-2706,
        # 2807-2811, 2853-2882), after ``model.language_model.`` -> ``model.`` (2774-2775).
        self.fused_experts = getattr(config, "model_type", None) == "qwen3_5_moe"
        if self.fused_experts:
            self.served.update({k: tuple(v.shape) for k, v in self.cpu.model.state_dict().items()
                                if _FUSED_EXPERTS.search(k)})
        self.context_len = int(context_length or config.get_text_config().max_position_embeddings)
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
        """qwen3_moe.py load_weights: unknown names skipped silently; a wrong shape fails the loader. Qwen3.5-MoE
        (one call = one load_weights call): once a fused expert name came, ``is_fused_expert`` stays set for the
        rest of the call and per-expert names no longer match (qwen3_5.py:2807-2811, 2843-2848) -> skipped with a
        warning only (2941-2960)."""
        fused_seen = False
        for name, tensor in named:
            if self.fused_experts and _FUSED_EXPERTS.search(name):
                fused_seen = True
            if name not in self.served or (fused_seen and _PER_EXPERT.search(name)):
                continue  # qwen3_moe.py:1224-1225 / 1266-1267; qwen3_5.py:2960 (a warning, success stays True)
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
        if flush_cache and not self._flush():  # managers/scheduler_components/weight_updater.py:120-133
            return False, ("Weights were updated, but the cache was not flushed because requests are still running "
                           "or queued. Retract or finish them, then call /flush_cache.")
        return True, "Success" if source == "tensor" else "Succeeded to update parameter online."

    # -- Engine API (signatures as entrypoints/engine.py) ---------------------------------------
    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                 return_routed_experts=False, image_data=None, **kwargs):
        self._alive("generate")
        if self.offload_tags & {"weights", "kv_cache"}:
            self._die(f"generate with released memory {sorted(self.offload_tags)} (illegal memory access)")
        single = input_ids and isinstance(input_ids[0], int)
        batch = [input_ids] if single else list(input_ids)
        images = self._images(image_data, len(batch), single)
        sps = sampling_params if isinstance(sampling_params, list) else [dict(sampling_params or {})] * len(batch)
        for ids, sp in zip(batch, sps):  # tokenizer_manager.py:1338-1378; all before any runs (batch path, item 7)
            seed = sp.get("sampling_seed")  # sampling/sampling_params.py:302-312: a plain int64, else the batch fails
            if seed is not None and not isinstance(seed, int):
                raise ValueError(f"sampling_seed must be an integer, got {type(seed).__name__}.")
            if seed is not None and not -(2**63) <= seed <= 2**63 - 1:
                raise ValueError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
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
        # item 10: the batch through the tokenizer manager, on the engine's loop (engine.py:528-542)
        return self.loop.run_until_complete(self.tokenizer_manager.generate_request(
            lambda: self._run_batch(batch, sps, single, images, return_logprob, return_routed_experts)))

    def _run_batch(self, batch, sps, single, images, return_logprob, return_routed_experts):
        """The scheduler's side of one batch (runs in the loop's executor: the loop stays free for a pause)."""
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
            s = self.cpu.generate([ids], params, 1, bool(return_routed_experts and self.return_routes),
                                  images=None if images[i] is None else [images[i]])[0][0]
            rid = f"req-{len(self.calls)}-{i}"
            if s.finish_reason == "abort" and s.response_ids:  # item 10: running when the pause came
                meta = {"id": rid, "finish_reason": {"type": "abort", "message": "Aborted", "status_code": None,
                                                     "err_type": None},
                        "prompt_tokens": len(ids), "completion_tokens": len(s.response_ids)}
                if return_logprob:
                    meta["output_token_logprobs"] = [(float(lp), int(t), None)
                                                     for lp, t in zip(s.logprobs, s.response_ids)]
                if return_routed_experts and self.return_routes:
                    import base64
                    meta["routed_experts"] = base64.b64encode(s.routed_experts.astype("<i4").tobytes()).decode()
                outputs.append({"text": None, "output_ids": list(s.response_ids), "meta_info": meta})
                continue
            if s.finish_reason == "abort":  # item 10: still waiting when the pause came (aborted as item 5)
                aborts.add(i)
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

    def _images(self, image_data, n: int, single: bool) -> list:
        """Per request: ImageInputs or None (item 11)."""
        from megatron_s3ac.models.multimodal import ImageInputs

        if image_data is None:
            return [None] * n
        per_req = [image_data] if single else list(image_data)
        if len(per_req) != n:  # io_struct.py:659-662
            raise ValueError("The length of image_data should be equal to the batch size.")
        out = []
        for items in per_req:
            if items is None or items == [None]:
                out.append(None)
                continue
            items = items if isinstance(items, list) else [items]
            fmt = [isinstance(it, dict) and it.get("format") == "processor_output" for it in items]
            if any(fmt) and len(items) != 1:  # base_processor.py:1225-1236
                raise ValueError(f"For Modality.IMAGE, when providing a 'processor_output' or 'precomputed_embedding', "
                                 f"you must pass exactly one item; received {len(items)} items")
            if not all(fmt):
                raise NotImplementedError("the stand-in takes processor_output image items only (raw images need "
                                          "sglang's processor on the decoded prompt, base_processor.py:1307-1309)")
            if not self.multimodal:
                raise ValueError("image data for a model served without multimodal (enable_multimodal=False or a "
                                 "text-only checkpoint)")
            out.append(ImageInputs(items[0]["pixel_values"], items[0]["image_grid_thw"]))
        return out

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
        if load_format == "flattened_bucket":  # engine.py:1690, 1751-1754: normalized in the caller, before any check
            payloads = [normalize_serialized_named_tensor_payload(p) for p in named_tensors]  # TypeError: alive
        if self.session is None:
            return False, SESSION_REQUIRED.format("update_weights_from_tensor")
        if self.offload_tags & {"weights"}:
            self._die("update_weights_from_tensor into released weights (illegal memory access)")
        if load_format == "flattened_bucket":
            self._load_flattened(payloads)
            return self._after_update(flush_cache, "tensor")
        if load_format is not None:
            self._die(f"NotImplementedError: Unknown load_format={load_format}")
        try:
            self._load(list(named_tensors))
        except AssertionError as err:  # uncaught on the tensor path: the scheduler dies
            self._die(f"Scheduler hit an exception: {err}")
        return self._after_update(flush_cache, "tensor")

    def _load_flattened(self, payloads: list) -> None:
        """Every TP rank's scheduler: its own payload (tp_worker.py:194-201), SafeUnpickler, reconstruct
        (model_executor/model_runner_components/weight_updater.py:383-413); rank 0's tensors go into the model."""
        bucket, self._flat_buckets = self._flat_buckets, self._flat_buckets + 1
        ranks = []
        for r in range(self.tp_size):
            try:
                data = payloads[r]  # IndexError with too few payloads
                named = _reconstruct(SafeUnpicklerModel(io.BytesIO(data)).load())
            except Exception as err:  # scheduler.py:6370-6373: the scheduler dies, the engine with it
                self._die(f"Scheduler hit an exception (TP rank {r}): {type(err).__name__}: {err}")
            pid = _PRODUCER_PID.search(data)
            ranks.append((r, int(pid.group(1)) if pid else None, named))
        try:  # sglang's weight loaders copy into the model's own parameters: nothing keeps the producer's memory
            self._load([(n, t.clone()) for n, t in ranks[0][2]])
        except AssertionError as err:  # uncaught on the tensor path: the scheduler dies
            self._die(f"Scheduler hit an exception: {err}")
        ref = ranks[0][2]
        same = [[n for n, _ in named] == [n for n, _ in ref] and all(
            t.dtype == u.dtype and t.shape == u.shape and torch.equal(t, u) for (_, t), (_, u) in zip(named, ref))
            for _, _, named in ranks]
        self.debug_payload_log.append({"bucket": bucket, "names": [n for n, _ in ref],
                                       "producers": [pid for _, pid, _ in ranks], "matches_rank0": same})
        del ranks, ref, named  # drop the mapped tensors: the producer's segment/IPC refcount goes back down

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                  backend="nccl"):
        self._alive("init_weights_update_group")
        from megatron_s3ac.rollout.engines.sglang.broadcast import init_custom_process_group

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
        except Exception as e:  # model_executor/model_runner_components/weight_updater.py:324-341
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
                self.offload_tags.remove(tag)  # managers/scheduler_components/weight_updater.py:389-390
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
    def debug_crash_scheduler_at_forward(self, n: int) -> None:
        """The scheduler hits an exception at its ``n``-th model forward from now (mid-generation), and the process
        holding this engine dies as sglang's does (item 10): the scheduler SIGQUITs its parent
        (managers/scheduler.py:6370-6373) - or, if the scheduler itself was killed, the engine's SubprocessWatchdog
        sees it within its 1 s poll and SIGQUITs its own process (utils/watchdog.py:166-232, started at
        entrypoints/engine.py:1313-1316) - and the handler calls ``kill_process_tree(os.getpid())``
        (entrypoints/engine.py:1976-1982, managers/tokenizer_manager.py:4072-4081), which SIGKILLs the process itself
        (utils/common.py:2548-2552). Modelled as that SIGKILL: no exception, no reply; the caller (a pool's Ray
        actor) sees the process gone. (Without a handler - the engine built off the main thread, engine.py:
        1987-1992 - SIGQUIT's default action ends the process too.)"""
        import signal

        count = [0]

        def hook(*_):
            count[0] += 1
            if count[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)

        self.cpu.model.register_forward_hook(hook)

    def debug_checkpoint_state_dict(self) -> dict:
        """The served weights under checkpoint names (what a sync must have written); for Qwen3.5-MoE the routed
        experts under both names its loader takes (per expert and fused [E, ...], see ``__init__``)."""
        from transformers.core_model_loading import revert_weight_conversion

        sd = dict(self.cpu.model.state_dict())
        out = revert_weight_conversion(self.cpu.model, dict(sd))
        if self.fused_experts:
            out.update({k: v for k, v in sd.items() if _FUSED_EXPERTS.search(k)})
        return out

    def debug_checkpoint_tensor(self, name: str) -> torch.Tensor:
        return self.debug_checkpoint_state_dict()[name]


def _reconstruct(payload) -> list:
    """model_executor/model_runner_components/weight_updater.py:383-413 (the six metadata attributes) +
    weight_sync/tensor_bucket.py:118-135 (views of the flat tensor by metadata)."""
    flat, out = payload["flattened_tensor"], []
    for m in payload["metadata"]:
        m = FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                    end_idx=m.end_idx, numel=m.numel)
        out.append((m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)))
    return out


@dataclasses.dataclass
class FlattenedTensorMetadata:  # weight_sync/tensor_bucket.py:7-16 (built on the engine side only)
    name: str
    shape: tuple
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


# the shared-memory segment a CPU payload names (torch's file_system strategy: "/torch_<pid>_<random>_<counter>")
_PRODUCER_PID = re.compile(rb"/torch_(\d+)_")


def normalize_serialized_named_tensor_payload(data) -> bytes:
    """utils/common.py:3109-3131, verbatim in behaviour."""
    if isinstance(data, str):
        return base64.b64decode(data, validate=True)
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = bytes(data)
        # _looks_like_pickle_payload, common.py:3105-3106
        if len(data) >= 2 and data[0] == 0x80 and data[1] <= pickle.HIGHEST_PROTOCOL:
            return data
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            return data
    raise TypeError("serialized_named_tensors entries must be base64 strings or bytes-like "
                    f"payloads, got {type(data).__name__}")


# utils/common.py:3148-3357 SafeUnpickler.ALLOWED_GLOBALS: the entries a tensor / storage / dtype / SimpleNamespace
# payload can need (Python types, torch's tensor and storage rebuild functions incl. the multiprocessing ones,
# dtypes, sglang's patched CUDA rebuild and its weight-sync containers). Left out: legacy torch.*Tensor /
# *Storage classes, sparse and quantized layouts, NPU, and sglang's request/multimodal classes.
_TORCH_DTYPES = (
    "bcomplex32 bfloat16 bit bits16 bits1x8 bits2x4 bits4x2 bits8 bool cdouble cfloat chalf complex128 complex32 "
    "complex64 double float float16 float32 float4_e2m1fn_x2 float64 float8_e4m3fn float8_e4m3fnuz float8_e5m2 "
    "float8_e5m2fnuz float8_e8m0fnu half int int1 int16 int2 int3 int32 int4 int5 int6 int64 int7 int8 long qint32 "
    "qint8 quint2x4 quint4x2 quint8 short uint1 uint16 uint2 uint3 uint32 uint4 uint5 uint6 uint64 uint7 uint8"
).split()  # common.py:3223-3279
SAFE_UNPICKLER_ALLOWED = frozenset({
    *(("builtins", n) for n in ("bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int",
                                "list", "range", "set", "slice", "str", "tuple")),  # common.py:3150-3163
    ("collections", "OrderedDict"), ("collections", "defaultdict"), ("collections", "deque"),
    ("collections", "Counter"), ("copyreg", "__newobj__"), ("copyreg", "__newobj_ex__"),
    ("functools", "partial"), ("itertools", "chain"), ("itertools", "repeat"),
    ("multiprocessing.reduction", "_rebuild_partial"), ("multiprocessing.reduction", "_rebuild_socket"),
    ("multiprocessing.resource_sharer", "DupFd"), ("types", "SimpleNamespace"),
    ("_codecs", "encode"),  # common.py:3164-3177
    ("torch", "Tensor"), ("torch", "Size"), ("torch", "device"), ("torch", "dtype"),  # common.py:3181, 3220-3222
    *(("torch", n) for n in _TORCH_DTYPES),
    ("torch.nn.parameter", "Parameter"), ("torch.serialization", "_get_layout"),  # common.py:3280-3293
    *(("torch._utils", n) for n in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3",
                                    "_rebuild_parameter", "_rebuild_parameter_with_state", "_rebuild_qtensor",
                                    "_rebuild_sparse_tensor", "_rebuild_meta_tensor_no_storage",
                                    "_rebuild_wrapper_subclass", "_rebuild_device_tensor_from_numpy",
                                    "_rebuild_device_tensor_from_cpu_tensor")),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "_UntypedStorage"), ("torch.storage", "TypedStorage"),
    ("torch", "UntypedStorage"),  # common.py:3294-3297
    *(("torch.multiprocessing.reductions", n) for n in (  # common.py:3327-3340
        "rebuild_tensor", "rebuild_meta_tensor", "rebuild_cuda_tensor", "rebuild_nested_tensor",
        "rebuild_sparse_coo_tensor", "rebuild_sparse_compressed_tensor", "rebuild_storage_fd",
        "rebuild_storage_filename", "rebuild_storage_empty", "rebuild_typed_storage", "rebuild_typed_storage_child")),
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),  # common.py:3330
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),  # common.py:3352-3357
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorBucket"),
    ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"),
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"),
})


def _safe_load_torch_storage(data: bytes):  # common.py:3135-3141
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, (torch.storage.TypedStorage, torch.UntypedStorage)):
        raise pickle.UnpicklingError(f"Expected a Torch storage, got {type(storage).__name__}")
    return storage


class SafeUnpicklerModel(pickle.Unpickler):
    """sglang's SafeUnpickler (utils/common.py:3144-3372) over SAFE_UNPICKLER_ALLOWED. The sglang entries resolve
    only where sglang is importable (not on CPU test machines: ModuleNotFoundError, which kills the scheduler too)."""

    def find_class(self, module, name):
        if (module, name) == ("torch.storage", "_load_from_bytes"):  # common.py:3362-3364
            return _safe_load_torch_storage
        if (module, name) in SAFE_UNPICKLER_ALLOWED:
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


def save_tiny_qwen3_moe(path, seed: int = 0, dtype: Optional[torch.dtype] = None, **overrides) -> str:
    """A tiny random Qwen3-MoE HF checkpoint (no dense layers: servable by sglang) saved at path, in ``dtype``
    (default float32)."""
    from transformers import AutoModelForCausalLM

    from rollout_fixtures import tiny_moe_config

    torch.manual_seed(seed)
    cfg = tiny_moe_config(**{"mlp_only_layers": [], **overrides})
    model = AutoModelForCausalLM.from_config(cfg)
    (model if dtype is None else model.to(dtype)).save_pretrained(str(path))
    return str(path)
