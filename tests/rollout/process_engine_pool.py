"""Test harness: the EnginePool interface (submit / wait / tp_sizes / sessions) over SGLangEngine wrappers of the
0.5.23 stand-in, each engine in a child process of its own serving its calls one at a time (as a Ray actor does),
so a multi-rank gloo test can drive the broadcast path without starting Ray in a rank. Engines must live in their
own processes, as real sglang engines do: torch registers a process group by name once per process, and every
engine and the stage leader join groups of the same name."""
import multiprocessing as mp
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _serve(conn, index, n, hf_dir, served_shapes, factory, path, tp_size=1, base_gpu_id=0):
    sys.path[:0] = path
    import torch

    torch.set_num_threads(1)
    from fake_sglang import FakeSGLangEngine
    from megatron_s3ac.rollout.engines.pool import EngineSlot
    from megatron_s3ac.rollout.engines.sglang.engine import SGLangConfig, SGLangEngine

    if factory is not None:  # e.g. rollout.factory.make_engine_factory(..., engine_cls=FakeSGLangEngine)
        engine = factory(EngineSlot(index, n))
    else:
        engine = SGLangEngine(SGLangConfig(model_path=hf_dir, tp_size=tp_size, base_gpu_id=base_gpu_id),
                              engine_cls=FakeSGLangEngine, served_shapes=served_shapes, name=f"sglang engine {index}")
    conn.send(int(engine.config.tp_size))
    while (msg := conn.recv()) is not None:
        cid, method, args, kwargs = msg
        try:
            obj = engine
            for part in method.split("."):
                obj = getattr(obj, part)
            conn.send((cid, True, obj(*args, **kwargs)))
        except BaseException as err:  # travels back with its type and message
            conn.send((cid, False, err))


class ProcessEnginePool:
    """tp_size: per engine (int or list); engine e's TP ranks sit on device slots base_gpu_ids[e] .. + tp_size - 1
    (default: back to back, engine e from the sum of the earlier engines' tp_size), as separate sglang engines on
    one node are given disjoint base_gpu_id."""

    def __init__(self, hf_dir, n, served_shapes=None, factory=None, tp_size=1, base_gpu_ids=None):
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        tps = list(tp_size) if isinstance(tp_size, (list, tuple)) else [int(tp_size)] * n
        bases = list(base_gpu_ids) if base_gpu_ids is not None else [sum(tps[:i]) for i in range(n)]
        for i in range(n):
            conn, child = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(child, i, n, hf_dir, served_shapes, factory, [HERE] + sys.path,
                                                 tps[i], bases[i]), daemon=True)
            p.start()
            self._conns.append(conn)
            self._procs.append(p)
        self.tp_sizes = [c.recv() for c in self._conns]
        self.num_engines, self._next, self._done = n, 0, {}

    def submit(self, e, method, *args, **kwargs):
        self._next += 1
        self._conns[e].send((self._next, method, args, kwargs))
        return e, self._next

    def wait(self, refs, what, timeout=None):
        for e, cid in refs:
            while cid not in self._done:
                if not self._conns[e].poll(timeout or 300):
                    raise TimeoutError(f"engine {e}: {what}: no answer")
                got, ok, val = self._conns[e].recv()
                self._done[got] = (ok, val)
        out = []
        for _, cid in refs:
            ok, val = self._done.pop(cid)
            if not ok:
                raise val
            out.append(val)
        return out

    def _all(self, method, *args):
        return self.wait([self.submit(e, method, *args) for e in range(self.num_engines)], method)

    def begin_weight_update(self):
        self._all("begin_weight_update")

    def end_weight_update(self):
        self._all("end_weight_update")

    def finish_sync(self, names, require_complete=False):
        self._all("finish_sync", list(names), bool(require_complete))

    def device_keys(self):
        """Per engine, its TP ranks' device keys (SGLangEngine.device_keys), like EnginePool.device_keys."""
        return self.wait([self.submit(e, "device_keys") for e in range(self.num_engines)], "device_keys")

    def close(self):
        """Stop every engine process (idempotent; an engine that does not stop within 30 s is killed)."""
        for c, p in zip(self._conns, self._procs):
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
        self._conns, self._procs = [], []


class TrainerTestPool(ProcessEnginePool):
    """What the trainer asks of its rollout engine besides the weight sync: generate (all prompts on engine 0:
    the broadcast path, not the prompt split, is under test) and close."""

    def generate(self, prompt_ids, params, n_samples=1, return_routed_experts=False):
        return self.wait([self.submit(0, "generate", [list(map(int, p)) for p in prompt_ids], params, n_samples,
                                      return_routed_experts)], "generate")[0]

    def shutdown(self):
        self.close()
