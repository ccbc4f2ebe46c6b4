"""The vLLM engine's server process: ``<vllm env python> -m megatron_s3ac.rollout.engines.vllm.server --spec FILE``.

Runs in the engine's own environment (``make vllm-env``: vLLM pins its own transformers), around one vLLM 0.32
``AsyncLLM`` (``v1/engine/async_llm.py``, built from ``AsyncEngineArgs`` with the keywords ``vllm.LLM`` took: the
same ``EngineArgs`` fields, ``engine/arg_utils.py``) driven by one asyncio loop on a thread of its own. The trainer
side (``rollout.engines.vllm.engine.VLLMEngine``) talks to it over loopback HTTP with JSON bodies; weights arrive
through vLLM's weight-transfer API with this package's backends (``worker_ext``: ``s3ac_gloo`` / ``s3ac_nccl``
groups, ``s3ac_ipc`` handles as JSON). Nothing is pickled across the boundary.

Why ``AsyncLLM`` and not the offline ``vllm.LLM``: ``LLM.generate`` runs every request of a call to its end and
serves one call at a time, so a running batch can be neither paused nor joined. ``AsyncLLM`` takes requests while
others run (each HTTP call's requests are added to the one engine core, which batches them continuously:
``add_request``, async_llm.py:388, then each request's ``RequestOutputCollector``), and pauses
(``pause_generation(mode="abort")``, async_llm.py:952-984): the engine core finishes every request it holds,
running or waiting, as aborted (``scheduler.finish_requests(None, FINISHED_ABORTED)`` and ``_send_abort_outputs``,
``v1/engine/core.py:2088-2092``, EngineCoreProc) and stops scheduling new ones until ``resume_generation`` (async_llm.py:986-988,
core.py:951-953); each aborted request's final output still carries every token sampled so far with its log-probs
(the output processor's cumulative / final-only output is built from the detokenizer's ``output_token_ids`` and the
log-prob processor's list, ``v1/engine/output_processor.py:428-482``, token ids 442, log-probs 445; finish_reason "abort"). That is partial
rollout's contract (rollout/partial.py): the trainer resubmits each aborted response as prompt + partial response
with the remaining budget after the weight sync.

Why a small server of our own rather than ``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1``: the OpenAI routes take
text-shaped requests (one seed per request, log-probs as top-k dicts keyed by decoded strings, no per-sample seeds
nor routed experts in the project's layout), and the dev-mode RL routes (``entrypoints/rl/online/api_router.py``)
call the same ``AsyncLLM`` methods used here; one process around ``AsyncLLM`` starts faster (no API server stack),
answers exactly the calls ``RolloutEngine`` needs, and its errors carry the call and the tensor.

Routes (POST, JSON; reply ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``): /health, /generate,
/generate_stream (one JSON line per finished group, then a closing line), /score, /pause_generation,
/continue_generation, /weight_info, /check_weights, /init_weight_transfer, /start_weight_update, /update_weights,
/finish_weight_update, /abort_weight_update, /stage_begin, /stage_bucket, /stage_abort, /commit_staged, /memory,
/flush_cache, /sleep, /wake_up, /shutdown.

Staged weights (``rollout.sync.overlap``; docs/rollout.md "Overlapped weight sync"): /stage_begin and /stage_bucket
run beside generation. Each bucket's receive is posted on the transfer group and the call returns
(``worker_ext.S3ACTransferEngine.stage_bucket``): the broadcast completes on gloo's thread (NCCL: its stream) while
the engine core goes on stepping on the live weights. /commit_staged {index, calls} waits until the ``calls``
generation calls the client sent before the swap (each carries ``commit``: the swaps it expects applied) have
ended, holds new ones off, and has the workers load the staged buckets as one weight-update session (a
``collective_rpc``: between two engine steps, with nothing running), then resets the prefix cache. A call that
expects the swap waits for it; a failed swap makes every later call fail.

Concurrency: generation calls (/generate, /generate_stream, /score) run side by side, continuously batched by the
engine. Control calls (weights, memory, sleep) are serialised among themselves. A weight-update session
(/start_weight_update .. /finish_weight_update or /abort_weight_update) and /sleep first wait until no generation
call runs (the old server's lock drained them the same way; paused, they have already returned) and a generation
call that arrives during a session waits for its end: vLLM would otherwise run decode steps between two buckets on
a half-updated model (a weight update is a ``collective_rpc`` utility call handled between two engine steps,
core.py:1547-1601). While paused, a generation call returns every request empty and aborted without reaching vLLM
(the base-class contract, rollout/base.py ``RolloutEngine``), where vLLM would hold it until resume.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import base64
import json
import os
import queue
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _finish_reason(reason) -> str:
    """vLLM's finish reason -> the project's (stop | length | abort); anything else (an error) counts as abort."""
    return reason if reason in ("stop", "length") else "abort"


def _routes(arr) -> dict | None:
    """A routed-experts array (vLLM: int16 [tokens, layers, top_k]) as JSON-safe raw bytes + dtype + shape."""
    if arr is None:
        return None
    import numpy as np

    a = np.ascontiguousarray(np.asarray(arr))
    return {"dtype": str(a.dtype), "shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode()}


def _row(out, detokenize: bool) -> dict:
    """One finished ``RequestOutput`` (one sample, n=1) as the client's JSON row."""
    c = out.outputs[0]
    ids = list(c.token_ids)
    lps = []
    for i, t in enumerate(ids):  # logprobs=0: the sampled token's own entry per position
        entry = c.logprobs[i] if c.logprobs is not None and i < len(c.logprobs) else None
        lps.append(float(entry[t].logprob) if entry is not None and t in entry else float("nan"))
    return {"token_ids": ids, "logprobs": lps, "finish_reason": _finish_reason(c.finish_reason),
            "text": c.text if detokenize else None,
            # GPU, enable_return_routed_experts: generated rows per choice, prompt rows per request
            "routed_experts": _routes(getattr(c, "routed_experts", None)),
            "prompt_routed_experts": _routes(getattr(out, "prompt_routed_experts", None))}


def _aborted_row(detokenize: bool) -> dict:
    """A request that never reached vLLM (it came while paused): no tokens, finish_reason abort."""
    return {"token_ids": [], "logprobs": [], "finish_reason": "abort", "text": "" if detokenize else None,
            "routed_experts": None, "prompt_routed_experts": None}


class Server:
    """One ``AsyncLLM`` on its own asyncio loop (thread ``vllm-loop``); HTTP handler threads hand it coroutines."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="vllm-loop").start()
        self.control = threading.Lock()  # control routes one at a time (weights, memory, sleep)
        self._ids = 0
        self.paused = False
        self.session_open = False  # a weight-update session holds the engine: generation waits
        self.asleep = False  # sleep until wake_up of the kv cache: generation waits (a weight session may run)
        self.running = 0  # generation calls inside vLLM
        # rollout.sync.overlap: swaps of a staged version applied so far; the generation calls that ended, by the
        # swap count they expected ("commit" in their body); a swap in progress holds new calls off
        self.commits = 0
        self.ended: collections.Counter = collections.Counter()
        self.swapping = False
        self.commit_error: str | None = None
        self.run(self._start(dict(spec["llm"])))

    def run(self, coro, timeout: float | None = None):
        """Run ``coro`` on the engine's loop from a handler thread; its result (or its exception)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, kw: dict) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kw.setdefault("disable_log_stats", True)  # vllm.LLM's default (entrypoints/llm.py:226-227)
        # built on the loop, so its output handler starts on it (async_llm.py:211-215)
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
        self.state = asyncio.Condition()  # guards paused / session_open / asleep / running (loop only)

    # -- generation ----------------------------------------------------------------------------------------------
    @staticmethod
    def _params(p: dict, seed: int, max_tokens: int, detokenize: bool):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # FINAL_ONLY: one output per request, when it finishes (or is aborted), with every token and log-prob so far
        # (output_processor.py:318-322, 428-445)
        return SamplingParams(
            n=1, temperature=float(p["temperature"]), top_p=float(p["top_p"]), top_k=int(p["top_k"]),
            max_tokens=int(max_tokens), stop_token_ids=list(p["stop_token_ids"]) or None,
            stop=list(p["stop_strings"]) or None, ignore_eos=bool(p["ignore_eos"]), seed=int(seed), logprobs=0,
            detokenize=detokenize, output_kind=RequestOutputKind.FINAL_ONLY)

    async def _admit(self, requests: list, commit: int | None = None) -> list | None:
        """Add every (prompt ids, SamplingParams) to the engine, all before a pause can land between them (the pause
        takes the same condition); the requests' output collectors, or None while paused (nothing added).
        ``commit``: the staged-weight swaps the client had sent before this call (None: unchecked); a call that
        expects a swap not yet applied waits for it, one that expects an older version is refused."""
        from vllm import TokensPrompt

        async with self.state:
            await self.state.wait_for(lambda: self.paused or not (
                self.session_open or self.asleep or self.swapping
                or (commit is not None and commit > self.commits and self.commit_error is None)))
            if self.paused:
                return None
            if self.commit_error is not None:
                raise RuntimeError(f"the staged weights could not be swapped in ({self.commit_error}); refusing to "
                                   f"generate on the previous version")
            if commit is not None and commit != self.commits:
                raise RuntimeError(f"a generation call expected the weights of swap {commit} but the engine holds "
                                   f"swap {self.commits}: it overtook a weight swap")
            self.running += 1
            added = []
            try:
                for ids, sp in requests:
                    self._ids += 1
                    rid = f"s3ac-{self._ids}"
                    # one ZMQ input socket carries adds and utility calls in order (core_client.py:1250-1298), so
                    # every request added here reaches the engine core before a later pause's abort
                    added.append(await self.llm.add_request(rid, TokensPrompt(prompt_token_ids=ids), sp))
            except BaseException:
                await self.llm.abort([q.request_id for q in added], internal=True)
                self.running -= 1
                self.state.notify_all()
                raise
            return added

    async def _done(self) -> None:
        async with self.state:
            self.running -= 1
            self.state.notify_all()

    @staticmethod
    async def _final(q):
        """The request's last output (as ``AsyncLLM.generate`` reads its collector, async_llm.py:765-775)."""
        from vllm.outputs import STREAM_FINISHED

        last = None
        try:
            while True:
                out = q.get_nowait() or await q.get()
                if out is not STREAM_FINISHED:
                    last = out
                if out is STREAM_FINISHED or out.finished:
                    return last
        finally:
            q.close()

    def _requests(self, req: dict) -> list:
        p = req["params"]
        budgets = req.get("max_new_tokens") or [p["max_new_tokens"]] * len(req["prompts"])
        if not len(req["prompts"]) == len(req["seeds"]) == len(budgets):
            raise ValueError(f"{len(req['prompts'])} prompts, {len(req['seeds'])} seeds and {len(budgets)} budgets")
        det = bool(req.get("detokenize", False))
        return [([int(t) for t in ids], self._params(p, seed, b, det))
                for ids, seed, b in zip(req["prompts"], req["seeds"], budgets)]

    async def _ended(self, commit: int | None) -> None:
        """A generation call that carried ``commit`` is over (however it ended): a swap waiting for it may run."""
        if commit is not None:
            async with self.state:
                self.ended[int(commit)] += 1
                self.state.notify_all()

    async def generate(self, req: dict, on_group=None) -> dict:
        """Every request to its end (or its abort by a pause); ``on_group(i, rows)``: called as each group of
        ``req["group_size"]`` consecutive requests finishes (``/generate_stream``)."""
        try:
            return await self._generate(req, on_group)
        finally:
            await self._ended(req.get("commit"))

    async def _generate(self, req: dict, on_group=None) -> dict:
        reqs = self._requests(req)
        det = bool(req.get("detokenize", False))
        t0 = time.time()
        qs = await self._admit(reqs, req.get("commit"))
        if qs is None:  # paused: nothing reached vLLM
            rows = [_aborted_row(det) for _ in reqs]
            if on_group is not None:
                k = int(req["group_size"])
                for i in range(len(reqs) // k):
                    on_group(i, rows[i * k:(i + 1) * k])
            return {"outputs": rows, "span": [t0, time.time()]}
        try:
            rows: list = [None] * len(qs)
            k = int(req.get("group_size") or len(qs) or 1)
            left = [min(k, len(qs) - i * k) for i in range((len(qs) + k - 1) // k)]

            async def one(j, q):
                rows[j] = _row(await self._final(q), det)
                g = j // k
                left[g] -= 1
                if on_group is not None and left[g] == 0:
                    on_group(g, rows[g * k:(g + 1) * k])
            await asyncio.gather(*[one(j, q) for j, q in enumerate(qs)])
        finally:
            await self._done()
        return {"outputs": rows, "span": [t0, time.time()]}

    async def score(self, req: dict) -> dict:
        """Teacher-forced log-probs of each sequence's tokens 1.. (vLLM's prompt_logprobs, temperature 1)."""
        try:
            return await self._score(req)
        finally:
            await self._ended(req.get("commit"))

    async def _score(self, req: dict) -> dict:
        from vllm import SamplingParams

        seqs = [[int(t) for t in ids] for ids in req["sequences"]]
        sp = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        qs = await self._admit([(ids, sp) for ids in seqs], req.get("commit"))
        if qs is None:
            raise RuntimeError("score while generation is paused (continue_generation first)")
        try:
            outs = await asyncio.gather(*[self._final(q) for q in qs])
        finally:
            await self._done()
        rows = []
        for ids, out in zip(seqs, outs):
            plp = out.prompt_logprobs or []
            rows.append([float(plp[i][t].logprob) for i, t in enumerate(ids) if i > 0])
        return {"logprobs": rows}

    async def pause(self) -> dict:
        """vLLM's pause in mode abort: every request it holds returns aborted with what it has; new calls return
        empty and aborted until ``resume``."""
        async with self.state:
            self.paused = True
            self.state.notify_all()  # a call waiting for a session's end returns aborted now
        await self.llm.pause_generation(mode="abort", clear_cache=True)
        return {}

    async def resume(self) -> dict:
        await self.llm.resume_generation()
        async with self.state:
            self.paused = False
            self.state.notify_all()
        return {}

    async def exclusive(self, coro_fn, flag: str = "session_open") -> None:
        """Wait until no generation call runs, set ``flag`` (which holds new ones off until ``release``), run
        ``coro_fn()``."""
        async with self.state:
            await self.state.wait_for(lambda: self.running == 0 and not getattr(self, flag))
            setattr(self, flag, True)
        try:
            await coro_fn()
        except BaseException:
            await self.release(flag)
            raise

    async def release(self, flag: str = "session_open") -> None:
        async with self.state:
            setattr(self, flag, False)
            self.state.notify_all()

    # -- staged weights (rollout.sync.overlap) ---------------------------------------------------------------------
    async def swap_when_due(self, req: dict) -> None:
        """Wait until every generation call the client sent before swap ``index`` (``calls`` of them, each
        carrying commit ``index - 1``) has ended and nothing else runs, then hold new calls off (``swapping``)."""
        index, calls = int(req["index"]), int(req["calls"])
        timeout = float(req.get("timeout_s", 600.0))
        async with self.state:
            try:
                await asyncio.wait_for(self.state.wait_for(
                    lambda: self.ended[index - 1] >= calls and self.running == 0
                    and not (self.session_open or self.asleep or self.swapping)), timeout)
            except asyncio.TimeoutError:
                raise RuntimeError(f"weight swap {index}: {self.ended[index - 1]} of the {calls} generation calls "
                                   f"sent before it ended within {timeout:g} s ({self.running} running)") from None
            if index != self.commits + 1:
                raise RuntimeError(f"weight swap {index} arrived after swap {self.commits}")
            self.swapping = True

    async def swap(self, req: dict) -> dict:
        """The staged version into the live model (``swapping`` set by ``swap_when_due``): the workers load it
        between two engine steps, the prefix cache (computed with the old weights) is reset, the version set."""
        t0, err = time.time(), None
        try:
            stale = sorted({n for w in await self.rpc("s3ac_commit_staged", float(req.get("timeout_s", 600.0)))
                            for n in w["stale"]})
            await self.llm.reset_prefix_cache()
            if req.get("weight_version") is not None:
                await self.llm.update_weight_version(str(req["weight_version"]))
        except BaseException as e:
            err = self.commit_error = f"{type(e).__name__}: {e}"
            raise
        finally:
            async with self.state:
                self.swapping = False
                if err is None:
                    self.commits = int(req["index"])
                self.state.notify_all()
        return {"stale": stale, "span": [t0, time.time()]}

    # -- weights -------------------------------------------------------------------------------------------------
    async def rpc(self, method: str, *args):
        return await self.llm.collective_rpc(method, args=tuple(args))

    async def control_call(self, route: str, req: dict) -> dict:
        llm = self.llm
        if route == "weight_info":
            return {"weights": (await self.rpc("s3ac_weight_info"))[0]}
        if route == "check_weights":
            await self.rpc("s3ac_check_weights", req["names"], req["shapes"], bool(req.get("session", False)))
            return {}
        if route == "init_weight_transfer":
            await llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": req["init_info"]})
            return {}
        if route == "start_weight_update":
            await self.exclusive(llm.start_weight_update)
            return {}
        if route == "update_weights":
            await llm.collective_rpc("update_weights", kwargs={"update_info": req["update_info"]})
            return {}
        if route == "finish_weight_update":
            try:
                await llm.finish_weight_update(weight_version=req.get("weight_version"))
                await llm.reset_prefix_cache()
                # tensors completed from served values an earlier update had replaced (worker_ext._settle)
                stale = sorted({n for w in await self.rpc("s3ac_last_session") for n in w["stale"]})
            finally:
                await self.release()
            return {"stale": stale}
        if route == "abort_weight_update":
            try:
                await self.rpc("s3ac_abort_weight_update")
            finally:
                await self.release()
            return {}
        if route == "stage_begin":  # beside generation: nothing waits for it
            await self.rpc("s3ac_stage_begin")
            return {}
        if route == "stage_bucket":  # posts the receive and returns; it completes while the engine decodes
            await self.rpc("s3ac_stage_bucket", req["update_info"])
            return {}
        if route == "stage_abort":
            await self.rpc("s3ac_stage_abort")
            return {}
        if route == "memory":
            return {"workers": await self.rpc("s3ac_memory")}
        if route == "flush_cache":
            return {"flushed": bool(await llm.reset_prefix_cache())}
        if route == "sleep":  # nothing runs (drained first; AsyncLLM.sleep would abort it, async_llm.py:1154-1160)
            await self.exclusive(lambda: llm.sleep(level=int(req.get("level", 1))), "asleep")
            return {}
        if route == "wake_up":  # generation waits until the kv cache is back (the colocated order wakes weights first)
            tags = req.get("tags")
            await llm.wake_up(tags=tags)
            if tags is None or "kv_cache" in tags:
                await self.release("asleep")
            return {}
        raise KeyError(f"unknown route /{route}")

    def call(self, route: str, req: dict) -> dict:
        """One route, from a handler thread."""
        if route == "health":
            if self.llm.errored:
                raise RuntimeError("the vLLM engine core is dead")
            return {}
        if route == "generate":
            return self.run(self.generate(req))
        if route == "score":
            return self.run(self.score(req))
        if route == "pause_generation":
            return self.run(self.pause())
        if route == "continue_generation":
            return self.run(self.resume())
        if route == "commit_staged":  # waits for the calls before it outside the control lock, swaps inside it
            self.run(self.swap_when_due(req))
            with self.control:
                return self.run(self.swap(req))
        with self.control:
            return self.run(self.control_call(route, req))

    def stream(self, req: dict, emit) -> None:
        """/generate_stream: ``emit(dict)`` per finished group ({"group": i, "outputs": rows}), then {"span": ...}."""
        lines: queue.Queue = queue.Queue()
        fut = asyncio.run_coroutine_threadsafe(
            self.generate(req, on_group=lambda i, rows: lines.put({"group": i, "outputs": rows})), self.loop)
        fut.add_done_callback(lambda _: lines.put(None))
        while (item := lines.get()) is not None:
            emit(item)
        emit({"span": fut.result()["span"]})

    def shutdown(self) -> None:
        try:  # ends vLLM's engine-core process before this one goes
            self.llm.shutdown()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)


def _handler(server: Server, stop: threading.Event):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet: the engine's own log goes to the log file
            pass

        def _send(self, body: dict, code: int) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            route = self.path.strip("/")
            started = False
            try:
                n = int(self.headers.get("Content-Length", 0))
                req = json.loads(self.rfile.read(n) or b"{}")
                if route == "shutdown":
                    stop.set()
                    return self._send({"ok": True}, 200)
                if route == "generate_stream":  # JSON lines, the connection closes after the last (HTTP/1.0)
                    self.send_response(200)
                    self.send_header("Content-Type", "application/x-ndjson")
                    self.end_headers()
                    started = True

                    def emit(item):
                        self.wfile.write((json.dumps({"ok": True, **item}) + "\n").encode())
                        self.wfile.flush()
                    return server.stream(req, emit)
                return self._send({"ok": True, **server.call(route, req)}, 200)
            except Exception as e:  # noqa: BLE001 - every error goes back to the caller, named
                traceback.print_exc()
                body = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                if started:
                    try:
                        self.wfile.write((json.dumps(body) + "\n").encode())
                    except OSError:
                        pass
                    return
                self._send(body, 500)

    return Handler


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", required=True, help="JSON file: {'llm': AsyncEngineArgs keywords, 'port_file': path}")
    args = ap.parse_args(argv)
    with open(args.spec) as f:
        spec = json.load(f)
    server = Server(spec)
    stop = threading.Event()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(server, stop))
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    tmp = spec["port_file"] + ".tmp"
    with open(tmp, "w") as f:  # written once the engine is up: the client's readiness signal
        f.write(str(httpd.server_address[1]))
    os.replace(tmp, spec["port_file"])
    stop.wait()
    httpd.shutdown()
    try:
        server.shutdown()
    except Exception:  # noqa: BLE001 - the client kills the process group if anything is left
        pass
    sys.stdout.flush()
    os._exit(0)  # vLLM's engine-core processes are children: exiting ends them (no atexit hang)


if __name__ == "__main__":
    sys.exit(main())
