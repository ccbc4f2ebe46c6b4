"""Verifiable rewards (+1 / -1), run in worker processes that a bad answer cannot stall.

- `register_reward("name")` is the plug-in point: a reward is fn(response: str, reference: str)
  -> float, defined at module level (workers receive it by reference and import its module).
- "math": math-verify parse + verify of the last \\boxed{} answer (or the response's tail) against
  the reference. "arithmetic": the CPU demo's task ("12+34=" -> +1 iff the digits equal 46).
- `RewardPool` runs isolated rewards in forkserver worker processes, one answer at a time per
  worker, with a wall-clock limit per answer: a worker that exceeds it is killed and replaced, a
  worker that dies is replaced, and the answer scores -1. Workers also run under an address-space
  limit so an answer like 10^10^10 fails with MemoryError instead of swapping the machine.
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import time
from collections import deque
from multiprocessing.connection import wait
from typing import Callable, Optional, Sequence

import numpy as np

RewardFn = Callable[[str, str], float]


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RewardSpec:
    name: str
    fn: RewardFn
    isolate: bool  # True: run in a worker process with a time limit; False: cheap, run inline


_REGISTRY: dict[str, RewardSpec] = {}


def register_reward(name: str, isolate: bool = True) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register fn(response, reference) -> float under `name`.

    isolate=False is for rewards that are cheap and bounded by construction (regex on short text);
    anything that parses or evaluates model output should stay isolated.
    """

    def decorator(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY and _REGISTRY[name].fn is not fn:
            raise ValueError(f"reward {name!r} is already registered")
        _REGISTRY[name] = RewardSpec(name, fn, isolate)
        return fn

    return decorator


def get_reward(name: str) -> RewardSpec:
    if name not in _REGISTRY:
        raise KeyError(f"unknown reward {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def registered_rewards() -> list[str]:
    return sorted(_REGISTRY)


def score_answers(name: str, responses: Sequence[str], references: Sequence[str],
                  pool: "Optional[RewardPool]" = None,
                  on_error: Optional[Callable[[int, BaseException], None]] = None) -> list[float]:
    """The one scoring path (training, the demo's coverage data, evaluation): rewards [N] of (response,
    reference) pairs. Rewards that may hang or blow up (``isolate``, e.g. math-verify) run in ``pool``'s
    worker processes under its per-answer time limit (a pool is required; its ``stats`` count timeouts,
    crashes and errors); cheap ones run inline. An answer that cannot be scored is wrong (-1);
    ``on_error(i, exc)`` is told about each inline one that raised (evaluation counts them)."""
    spec = get_reward(name)
    if spec.isolate:
        if pool is None:
            raise ValueError(f"reward {name!r} runs in worker processes: pass a RewardPool")
        return pool.score(name, responses, references).tolist()
    out = []
    for i, (text, ref) in enumerate(zip(responses, references)):
        try:
            out.append(float(spec.fn(text, ref)))
        except Exception as exc:  # noqa: BLE001 - an unscorable answer is wrong
            out.append(-1.0)
            if on_error is not None:
                on_error(i, exc)
    return out


# ----------------------------------------------------------------------------------------------
# Math reward
# ----------------------------------------------------------------------------------------------
MAX_ANSWER_CHARS = 1000  # an extracted answer longer than this is not a final answer: -1 unparsed
TAIL_CHARS = 1000  # without \boxed{}, only the response's tail is searched for an answer
MATH_VERIFY_TIMEOUT_S = 2  # math-verify's own (signal-based) limits, below the pool's hard limit


def extract_last_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...} (or \\fbox{...}) with balanced braces, else None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    open_at = text.find("{", start)
    if open_at < 0:
        return None
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1: i]
    return None  # unbalanced: no complete answer


def _parse_reference(reference: str):
    from math_verify import parse

    # References are usually bare LaTeX ("\frac12"): math-verify wants it inside $...$.
    gold = parse(reference if "$" in reference else f"${reference}$", parsing_timeout=MATH_VERIFY_TIMEOUT_S)
    return gold or parse(reference, parsing_timeout=MATH_VERIFY_TIMEOUT_S)


@register_reward("math")
def math_reward(response: str, reference: str) -> float:
    """+1 if the response's final answer equals the reference (math-verify), else -1."""
    from math_verify import parse, verify

    if not isinstance(response, str) or not isinstance(reference, str):
        return -1.0
    boxed = extract_last_boxed(response)
    candidate = f"\\boxed{{{boxed}}}" if boxed is not None else response[-TAIL_CHARS:]
    if boxed is not None and len(boxed) > MAX_ANSWER_CHARS:
        return -1.0
    gold = _parse_reference(reference)
    pred = parse(candidate, parsing_timeout=MATH_VERIFY_TIMEOUT_S)
    if not gold or not pred:
        return -1.0
    return 1.0 if verify(gold, pred, timeout_seconds=MATH_VERIFY_TIMEOUT_S) else -1.0


# ----------------------------------------------------------------------------------------------
# Worker pool
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class RewardStats:
    """Counts over every answer scored by a pool (cumulative until reset)."""

    total: int = 0
    positive: int = 0
    timeouts: int = 0  # hit the hard limit: worker killed and replaced
    crashes: int = 0  # worker died (segfault, os._exit, OOM kill)
    errors: int = 0  # the reward raised (e.g. MemoryError, RecursionError)
    workers_replaced: int = 0
    max_seconds: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _limit_memory(memory_limit_mb: Optional[int]) -> None:
    if memory_limit_mb:
        import resource

        limit = memory_limit_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _warm_up() -> None:
    """Parse and verify one answer before declaring the worker ready: math-verify builds its LaTeX
    grammar and sympy caches lazily, and on a cold machine that first call can exceed math-verify's
    own 2 s limit, silently scoring a correct answer -1. Not counted against any answer's time."""
    try:
        math_reward("\\boxed{\\frac{1}{2}}", "0.5")
    except Exception:
        pass


def _worker_main(conn, memory_limit_mb: Optional[int]) -> None:
    """Worker loop: receive (task_id, fn, response, reference), send (task_id, reward, status)."""
    _limit_memory(memory_limit_mb)
    _warm_up()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        task_id, fn, response, reference = msg
        try:
            reward, status = float(fn(response, reference)), "ok"
        except BaseException as exc:  # noqa: BLE001 - any failure of an answer is a -1, not a crash
            reward, status = -1.0, f"error:{type(exc).__name__}"
        try:
            conn.send((task_id, reward, status))
        except (BrokenPipeError, OSError):
            return


class _Worker:
    def __init__(self, ctx, memory_limit_mb):
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, memory_limit_mb), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.task: Optional[int] = None
        self.deadline = float("inf")
        self.started = 0.0

    def kill(self):
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class RewardPool:
    """Scores answers in worker processes with a hard per-answer time limit.

    num_workers: processes (each scores one answer at a time). timeout_s: wall-clock limit per
    answer, counted from dispatch. memory_limit_mb: address-space limit per worker (None: none).
    """

    def __init__(self, num_workers: int = 2, timeout_s: float = 5.0, memory_limit_mb: Optional[int] = 4096,
                 start_method: str = "forkserver"):
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        self.timeout_s = float(timeout_s)
        self.memory_limit_mb = memory_limit_mb
        self.stats = RewardStats()
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            # Forks from a server that already imported math-verify (sympy): replacing a killed
            # worker costs milliseconds instead of a fresh interpreter plus imports.
            self._ctx.set_forkserver_preload(["megatron_s3ac.rollout.rewards", "math_verify",
                                             "megatron_s3ac.rollout.rewards._warm"])
        self._workers = [_Worker(self._ctx, memory_limit_mb) for _ in range(num_workers)]
        self._startup_failures = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        for w in self._workers:
            try:
                w.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for w in self._workers:
            w.proc.join(timeout=2)
            w.kill()
        self._workers = []

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = _Worker(self._ctx, self.memory_limit_mb)
        self.stats.workers_replaced += 1

    def _record(self, reward: float, status: str, seconds: float) -> float:
        self.stats.total += 1
        self.stats.positive += reward > 0
        self.stats.max_seconds = max(self.stats.max_seconds, seconds)
        if status == "timeout":
            self.stats.timeouts += 1
        elif status == "crash":
            self.stats.crashes += 1
        elif status.startswith("error"):
            self.stats.errors += 1
        return reward

    def score(self, name: str, responses: Sequence[str], references: Sequence[str]) -> np.ndarray:
        """Rewards [N] float32 for N (response, reference) pairs with the registered reward `name`."""
        if len(responses) != len(references):
            raise ValueError(f"{len(responses)} responses for {len(references)} references")
        spec = get_reward(name)
        out = np.full(len(responses), -1.0, dtype=np.float32)
        if not spec.isolate:
            for i, (resp, ref) in enumerate(zip(responses, references)):
                t0 = time.monotonic()
                try:
                    reward, status = float(spec.fn(resp, ref)), "ok"
                except Exception as exc:  # noqa: BLE001
                    reward, status = -1.0, f"error:{type(exc).__name__}"
                out[i] = self._record(reward, status, time.monotonic() - t0)
            return out

        stream = RewardStream(self, name)
        stream.add(0, responses, references)
        (got,) = stream.wait_all()
        return got[1]

    def stream(self, name: str) -> "RewardStream":
        """Scoring that takes answers as they arrive and hands back each key's rewards once all are scored
        (streaming rewards: a group is scored while later groups still generate)."""
        return RewardStream(self, name)


class RewardStream:
    """Incremental scoring on a ``RewardPool``: ``add(key, responses, references)`` queues a group of answers (an
    isolated reward goes to the pool's workers as they free up; a cheap one is scored inline, now);
    ``poll(timeout_s)`` dispatches, waits at most ``timeout_s`` for the workers and returns the (key, rewards [n]
    float32) of every group completed since the last call, in the order they completed; ``wait_all()`` until none is
    left. Same per-answer limits, replacement and counts as ``RewardPool.score`` (which is this with one key). One
    stream (or ``score``) at a time per pool: the workers answer whoever dispatched to them."""

    def __init__(self, pool: RewardPool, name: str):
        self.pool, self.spec = pool, get_reward(name)
        self._todo: deque = deque()  # (key, j) not dispatched yet
        self._args: dict = {}  # (key, j) -> (response, reference)
        self._out: dict = {}  # key -> rewards [n]
        self._left: dict = {}  # key -> answers not scored yet
        self._done: list = []  # completed keys not yet handed back
        self.busy = 0

    @property
    def pending(self) -> int:
        """Groups added and not yet handed back."""
        return len(self._out)

    def add(self, key, responses: Sequence[str], references: Sequence[str]) -> None:
        if len(responses) != len(references):
            raise ValueError(f"{len(responses)} responses for {len(references)} references")
        if key in self._out:
            raise ValueError(f"group {key!r} is already being scored")
        self._out[key] = np.full(len(responses), -1.0, dtype=np.float32)
        self._left[key] = len(responses)
        if not self.spec.isolate:
            for j, (resp, ref) in enumerate(zip(responses, references)):
                t0 = time.monotonic()
                try:
                    reward, status = float(self.spec.fn(resp, ref)), "ok"
                except Exception as exc:  # noqa: BLE001
                    reward, status = -1.0, f"error:{type(exc).__name__}"
                self._finish((key, j), self.pool._record(reward, status, time.monotonic() - t0))
        else:
            for j, (resp, ref) in enumerate(zip(responses, references)):
                self._args[(key, j)] = (resp, ref)
                self._todo.append((key, j))
        if not self._left[key] and key not in self._done:  # an empty group, or scored inline
            self._done.append(key)

    def _finish(self, task, reward: float) -> None:
        key, j = task
        self._out[key][j] = reward
        self._left[key] -= 1
        self._args.pop(task, None)
        if not self._left[key]:
            self._done.append(key)

    def _hand_back(self) -> list:
        done, self._done = self._done, []
        for k in done:
            del self._left[k]
        return [(k, self._out.pop(k)) for k in done]

    def poll(self, timeout_s: float = 0.0) -> list:
        """One round of dispatch and wait (at most ``timeout_s``, less when a per-answer deadline comes first)."""
        pool = self.pool
        if self._todo or self.busy:
            now = time.monotonic()
            for w in pool._workers:  # dispatch to idle, ready workers
                if self._todo and w.ready and w.task is None:
                    task = self._todo.popleft()
                    w.conn.send((task, self.spec.fn, *self._args[task]))
                    w.task, w.started, w.deadline = task, now, now + pool.timeout_s
                    self.busy += 1
            next_deadline = min((w.deadline for w in pool._workers if w.task is not None), default=now + 1.0)
            wait_s = max(0.0, min(next_deadline - time.monotonic(), timeout_s))
            readable = wait([w.conn for w in pool._workers], timeout=wait_s)
            now = time.monotonic()
            for k, w in enumerate(list(pool._workers)):
                if w.conn in readable:
                    try:
                        msg = w.conn.recv()
                    except (EOFError, OSError):  # the worker died
                        if not w.ready:
                            pool._startup_failures += 1
                            if pool._startup_failures > 3 * len(pool._workers):
                                raise RuntimeError("reward workers keep dying at start-up")
                        if w.task is not None:
                            self._finish(w.task, pool._record(-1.0, "crash", now - w.started))
                            self.busy -= 1
                        pool._replace(k)
                        continue
                    if msg[0] == "ready":
                        w.ready = True
                    else:
                        task_id, reward, status = msg
                        self._finish(tuple(task_id), pool._record(reward, status, now - w.started))
                        w.task, w.deadline = None, float("inf")
                        self.busy -= 1
                elif w.task is not None and now >= w.deadline:  # over the limit: kill and replace
                    self._finish(w.task, pool._record(-1.0, "timeout", now - w.started))
                    self.busy -= 1
                    pool._replace(k)
        return self._hand_back()

    def wait_all(self) -> list:
        """Every group still pending, (key, rewards) in completion order."""
        out = self._hand_back()
        while self._todo or self.busy:
            out += self.poll(timeout_s=1.0)
        return out


# The toy tasks' rewards, each defined beside its prompts (tasks/<task>.py; pure string functions, no torch)
from megatron_s3ac.tasks import REWARDS as _TASK_REWARDS  # noqa: E402

for _task_reward in _TASK_REWARDS:
    register_reward(_task_reward.name, isolate=_task_reward.isolate)(_task_reward.fn)
