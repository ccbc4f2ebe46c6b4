"""Judges of free-form (Minerva-style) answers: math-verify (the default: the training reward, unchanged)
or an LLM judge behind an OpenAI-compatible ``/v1/chat/completions`` endpoint.

The paper scores Minerva with an LLM-based judge "to accommodate numerical approximations and equivalent
symbolic expressions" (S3AC §4.1, footnote 1); its judge model and prompt are not in the paper, so the
prompt below is ours (``JUDGE_SYSTEM``) and the model is whatever the endpoint serves.

LLM judge contract:
- one request per (question, final answer, reference), ``temperature`` 0, ``max_tokens`` bounded; the
  final answer is the response's last ``\\boxed{}`` (else its last ``TAIL_CHARS`` characters), as the
  math reward extracts it; an empty response is incorrect without a call;
- the verdict is parsed strictly: the reply's last non-empty line must be ``VERDICT: CORRECT`` or
  ``VERDICT: INCORRECT`` (case-insensitive); anything else is *unparsable*: scored incorrect and counted
  (``judge_unparsable``), never counted as correct;
- each request has a bounded timeout; timeouts, connection errors, HTTP 429 and 5xx are retried
  ``max_retries`` times with doubling back-off, then the evaluation stops with ``JudgeError`` naming the
  endpoint (no partial report); any other HTTP error (401 bad key, 404 unknown model) stops at once;
- the endpoint is checked before anything is generated (``check``), so a down server fails in seconds,
  not after hours of generation;
- the API key is read from the environment variable *named* by the config (``api_key_env``), never
  from the config itself.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import time
from typing import Optional, Sequence

import numpy as np

from megatron_s3ac.eval.benchmarks import EvalInputError
from megatron_s3ac.rollout.rewards import TAIL_CHARS, extract_last_boxed

JUDGES = ("math_verify", "llm")
JUDGE_SYSTEM = (
    "You grade the final answer of a solution to a math problem against the reference answer. The final "
    "answer is correct if it is mathematically equivalent to the reference: equivalent symbolic forms, "
    "the same set or interval written differently, and numerical approximations that agree with the reference "
    "to the precision the problem asks for (else to about three significant digits) count as correct. "
    "Units and formatting do not matter. Do not solve the problem yourself. End your reply with one line, "
    "exactly 'VERDICT: CORRECT' or 'VERDICT: INCORRECT'.")
_VERDICT = re.compile(r"^\s*VERDICT:\s*(CORRECT|INCORRECT)\s*\.?\s*$", re.IGNORECASE)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


class JudgeError(EvalInputError):
    """The LLM judge cannot give verdicts (endpoint down, refusing, misconfigured): the evaluation stops."""


def parse_verdict(content) -> Optional[bool]:
    """True / False from a reply whose last non-empty line is ``VERDICT: CORRECT`` / ``INCORRECT``; None otherwise."""
    if not isinstance(content, str):
        return None
    lines = [line for line in content.strip().splitlines() if line.strip()]
    m = _VERDICT.match(lines[-1]) if lines else None
    return None if m is None else m.group(1).upper() == "CORRECT"


def final_answer(response: str) -> str:
    """What the judge is shown: the last \\boxed{} content, else the response's tail (as the math reward)."""
    boxed = extract_last_boxed(response)
    return boxed.strip() if boxed is not None else response[-TAIL_CHARS:].strip()


def chat_completions_url(url: str) -> str:
    """``http://host:8000`` / ``.../v1`` / ``.../v1/chat/completions`` -> the chat-completions endpoint."""
    u = url.rstrip("/")
    if u.endswith("/chat/completions"):
        return u
    return u + ("/chat/completions" if u.endswith("/v1") else "/v1/chat/completions")


@dataclasses.dataclass
class LLMJudge:
    """Scores answers through an OpenAI-compatible chat-completions endpoint (module docstring).

    url: server base (``http://host:8000``), ``.../v1`` or the full endpoint. model: the served model name.
    api_key_env: name of the environment variable holding the key (None: no Authorization header).
    sets: benchmark names this judge scores; empty: every set scored with the ``math`` reward.
    """

    url: str
    model: str
    api_key_env: Optional[str] = None
    timeout_s: float = 60.0
    max_retries: int = 3
    concurrency: int = 8
    max_tokens: int = 1024
    sets: tuple = ()
    backoff_s: float = 0.5

    def __post_init__(self):
        if not self.url or not self.model:
            raise JudgeError("the LLM judge needs a url and a model (eval.judge.url / .model, --judge-url / --judge-model)")
        if self.api_key_env is not None and not _ENV_NAME.match(self.api_key_env):
            raise JudgeError("eval.judge.api_key_env / --judge-key-env must name an environment variable that holds "
                             "the key, not the key itself")
        if self.timeout_s <= 0 or self.max_retries < 0 or self.concurrency < 1:
            raise JudgeError("judge timeout_s must be > 0, max_retries >= 0, concurrency >= 1")
        self.sets = tuple(self.sets)
        self.endpoint = chat_completions_url(self.url)
        import requests  # pinned in setup.py / requirements-cpu.txt

        self._requests = requests
        self._session = requests.Session()

    @property
    def label(self) -> str:
        return f"llm:{self.model}"

    def applies(self, name: str, reward: str) -> bool:
        """Whether this judge scores benchmark `name` (whose math items would use reward `reward`)."""
        return name in self.sets if self.sets else reward == "math"

    def _headers(self) -> dict:
        if self.api_key_env is None:
            return {}
        key = os.environ.get(self.api_key_env)
        if not key:
            raise JudgeError(f"the LLM judge's key variable {self.api_key_env} is not set in the environment")
        return {"Authorization": f"Bearer {key}"}

    def check(self) -> None:
        """Fail fast when the endpoint cannot be reached (any HTTP answer counts as reachable)."""
        headers = self._headers()
        models = self.endpoint.rsplit("/chat/completions", 1)[0] + "/models"
        try:
            self._session.get(models, headers=headers, timeout=min(self.timeout_s, 10.0))
        except self._requests.RequestException as e:
            raise JudgeError(f"the LLM judge endpoint {self.endpoint} is not reachable ({type(e).__name__}: {e}); "
                             f"is the server up? (eval.judge.url / --judge-url)") from None

    def _ask(self, question: str, answer: str, reference: str, headers: dict) -> Optional[bool]:
        body = {"model": self.model, "temperature": 0.0, "max_tokens": self.max_tokens,
                "messages": [{"role": "system", "content": JUDGE_SYSTEM},
                             {"role": "user", "content": f"Problem:\n{question}\n\nReference answer:\n{reference}\n\n"
                                                         f"Final answer to grade:\n{answer}"}]}
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                r = self._session.post(self.endpoint, json=body, headers=headers,
                                       timeout=(min(self.timeout_s, 10.0), self.timeout_s))
            except self._requests.RequestException as e:  # connection refused / reset, timeout
                last = f"{type(e).__name__}: {e}"
                continue
            if r.status_code in _RETRY_STATUS:
                last = f"HTTP {r.status_code}: {r.text[:200]}"
                continue
            if r.status_code != 200:
                raise JudgeError(f"the LLM judge at {self.endpoint} refused the request: HTTP {r.status_code}: "
                                 f"{r.text[:300]} (model {self.model!r}; key from {self.api_key_env or 'no variable'})")
            try:
                data = r.json()
            except ValueError:
                last = f"a reply that is not JSON: {r.text[:200]!r}"
                continue
            try:
                content = data["choices"][0]["message"]["content"]
            except (KeyError, IndexError, TypeError):
                return None  # a reply without a message: unparsable, counted
            return parse_verdict(content)
        raise JudgeError(f"the LLM judge at {self.endpoint} failed {self.max_retries + 1} times "
                         f"(timeout {self.timeout_s:g} s each); last: {last}")

    def score(self, questions: Sequence[str], responses: Sequence[str],
              references: Sequence[str]) -> tuple[np.ndarray, dict[str, int]]:
        """Correctness [N] bool and counts {"judge_calls", "judge_unparsable"}; raises JudgeError (see above)."""
        if not len(questions) == len(responses) == len(references):
            raise ValueError("questions, responses and references must have one entry each")
        headers = self._headers()
        verdicts: list[Optional[bool]] = [False] * len(responses)
        todo = [i for i, r in enumerate(responses) if r and r.strip()]
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            futures = {pool.submit(self._ask, questions[i], final_answer(responses[i]), references[i], headers): i
                       for i in todo}
            try:
                for f in concurrent.futures.as_completed(futures):
                    verdicts[futures[f]] = f.result()
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
        unparsable = sum(v is None for v in verdicts)
        return np.array([v is True for v in verdicts], dtype=bool), {"judge_calls": len(todo),
                                                                     "judge_unparsable": unparsable}


def make_judge(name: str = "math_verify", **kwargs) -> Optional[LLMJudge]:
    """None for ``math_verify`` (scoring stays on the reward path), an LLMJudge for ``llm``."""
    if name not in JUDGES:
        raise JudgeError(f"unknown judge {name!r}; one of {JUDGES}")
    if name == "math_verify":
        return None
    return LLMJudge(**{k: v for k, v in kwargs.items() if v is not None})
