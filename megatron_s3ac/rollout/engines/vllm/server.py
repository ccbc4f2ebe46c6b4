"""The vLLM engine's server process: ``<vllm env python> -m megatron_s3ac.rollout.engines.vllm.server --spec FILE``.

Runs in the engine's own environment (``make vllm-env``: vLLM pins its own transformers), around one ``vllm.LLM``
(``entrypoints/llm.py``). The trainer side (``rollout.engines.vllm.engine.VLLMEngine``) talks to it over loopback HTTP
with JSON bodies; weights arrive through vLLM's weight-transfer API with this package's backends (``worker_ext``:
``s3ac_gloo`` / ``s3ac_nccl`` groups, ``s3ac_ipc`` handles as JSON). Nothing is pickled across the boundary.

Why a small server of our own rather than ``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1``: the OpenAI routes
take text-shaped requests (one seed per request, log-probs as top-k dicts keyed by decoded strings, no per-sample
seeds nor routed experts in the project's layout), and the dev-mode RL routes (``entrypoints/rl/online``) call the
same ``LLM`` methods used here; one process around ``vllm.LLM`` starts faster (no API server stack), answers
exactly the calls ``RolloutEngine`` needs, and its errors carry the call and the tensor.

Routes (POST, JSON; reply ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``): /health, /generate, /score,
/weight_info, /check_weights, /init_weight_transfer, /start_weight_update, /update_weights, /finish_weight_update,
/abort_weight_update, /memory, /flush_cache, /sleep, /wake_up, /shutdown. Calls into the engine are serialised.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import threading
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


class Server:
    def __init__(self, spec: dict):
        from vllm import LLM

        self.spec = spec
        self.lock = threading.Lock()
        kw = dict(spec["llm"])
        self.llm = LLM(**kw)

    # -- generation ----------------------------------------------------------------------------------------------
    def generate(self, req: dict) -> dict:
        from vllm import SamplingParams, TokensPrompt

        p = req["params"]
        prompts, params = [], []
        for ids, seed in zip(req["prompts"], req["seeds"]):  # one request per sample, each with its own seed
            prompts.append(TokensPrompt(prompt_token_ids=[int(t) for t in ids]))
            params.append(SamplingParams(
                n=1, temperature=float(p["temperature"]), top_p=float(p["top_p"]), top_k=int(p["top_k"]),
                max_tokens=int(p["max_new_tokens"]), stop_token_ids=list(p["stop_token_ids"]) or None,
                stop=list(p["stop_strings"]) or None, ignore_eos=bool(p["ignore_eos"]), seed=int(seed),
                logprobs=0, detokenize=bool(req.get("detokenize", False))))
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        rows = []
        for out in outs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            lps = []
            for i, t in enumerate(ids):  # logprobs=0: the sampled token's own entry per position
                entry = c.logprobs[i] if c.logprobs is not None and i < len(c.logprobs) else None
                lps.append(float(entry[t].logprob) if entry is not None and t in entry else float("nan"))
            rows.append({"token_ids": ids, "logprobs": lps, "finish_reason": _finish_reason(c.finish_reason),
                         "text": c.text if req.get("detokenize") else None,
                         # GPU, enable_return_routed_experts: generated rows per choice, prompt rows per request
                         "routed_experts": _routes(getattr(c, "routed_experts", None)),
                         "prompt_routed_experts": _routes(getattr(out, "prompt_routed_experts", None))})
        return {"outputs": rows}

    def score(self, req: dict) -> dict:
        """Teacher-forced log-probs of each sequence's tokens 1.. (vLLM's prompt_logprobs, temperature 1)."""
        from vllm import SamplingParams, TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in ids]) for ids in req["sequences"]]
        sp = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        rows = []
        for ids, out in zip(req["sequences"], self.llm.generate(prompts, sp, use_tqdm=False)):
            plp = out.prompt_logprobs or []
            rows.append([float(plp[i][int(t)].logprob) for i, t in enumerate(ids) if i > 0])
        return {"logprobs": rows}

    # -- weights -------------------------------------------------------------------------------------------------
    def rpc(self, method: str, *args):
        return self.llm.collective_rpc(method, args=tuple(args))

    def call(self, route: str, req: dict) -> dict:
        llm = self.llm
        if route == "health":
            return {}
        if route == "generate":
            return self.generate(req)
        if route == "score":
            return self.score(req)
        if route == "weight_info":
            return {"weights": self.rpc("s3ac_weight_info")[0]}
        if route == "check_weights":
            self.rpc("s3ac_check_weights", req["names"], req["shapes"], bool(req.get("session", False)))
            return {}
        if route == "init_weight_transfer":
            llm.init_weight_transfer_engine({"init_info": req["init_info"]})
            return {}
        if route == "start_weight_update":
            llm.start_weight_update()
            return {}
        if route == "update_weights":
            llm.update_weights({"update_info": req["update_info"]})
            return {}
        if route == "finish_weight_update":
            llm.finish_weight_update(weight_version=req.get("weight_version"))
            llm.reset_prefix_cache()
            # tensors completed from served values an earlier update had replaced (worker_ext._settle)
            return {"stale": sorted({n for w in self.rpc("s3ac_last_session") for n in w["stale"]})}
        if route == "abort_weight_update":
            self.rpc("s3ac_abort_weight_update")
            return {}
        if route == "memory":
            return {"workers": self.rpc("s3ac_memory")}
        if route == "flush_cache":
            return {"flushed": bool(llm.reset_prefix_cache())}
        if route == "sleep":
            llm.sleep(level=int(req.get("level", 1)))
            return {}
        if route == "wake_up":
            llm.wake_up(tags=req.get("tags"))
            return {}
        raise KeyError(f"unknown route /{route}")


def _handler(server: Server, stop: threading.Event):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet: the engine's own log goes to the log file
            pass

        def do_POST(self):
            route = self.path.strip("/")
            try:
                n = int(self.headers.get("Content-Length", 0))
                req = json.loads(self.rfile.read(n) or b"{}")
                if route == "shutdown":
                    body, code = {"ok": True}, 200
                    stop.set()
                else:
                    with server.lock:
                        body, code = {"ok": True, **server.call(route, req)}, 200
            except Exception as e:  # noqa: BLE001 - every error goes back to the caller, named
                traceback.print_exc()
                body, code = {"ok": False, "error": f"{type(e).__name__}: {e}"}, 500
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", required=True, help="JSON file: {'llm': vllm.LLM keywords, 'port_file': path}")
    args = ap.parse_args(argv)
    with open(args.spec) as f:
        spec = json.load(f)
    server = Server(spec)
    stop = threading.Event()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(server, stop))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    tmp = spec["port_file"] + ".tmp"
    with open(tmp, "w") as f:  # written once the engine is up: the client's readiness signal
        f.write(str(httpd.server_address[1]))
    os.replace(tmp, spec["port_file"])
    stop.wait()
    httpd.shutdown()
    try:  # end vLLM's engine-core process before this one goes
        server.llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - the client kills the process group if anything is left
        pass
    sys.stdout.flush()
    os._exit(0)  # vLLM's engine-core processes are children: exiting ends them (no atexit hang)


if __name__ == "__main__":
    sys.exit(main())
