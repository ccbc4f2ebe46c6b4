"""The LLM judge against a real local HTTP server speaking OpenAI's chat-completions JSON (http.server in a
thread): verdicts parsed strictly (an unparsable reply is incorrect and counted), retries on 503,
a bounded timeout, a clear error when the endpoint is down or refuses, the key read from a named
environment variable, and evaluate() / s3ac-eval wired to it."""
import json
import re
import socket
import threading
import time
from fractions import Fraction
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from eval_fixtures import arithmetic_rows
from megatron_s3ac.eval.judge import JudgeError, LLMJudge, chat_completions_url, make_judge, parse_verdict
from megatron_s3ac.eval.runner import BenchmarkSpec, evaluate
from megatron_s3ac.rollout.base import SamplingParams

KEY_ENV, KEY = "S3AC_TEST_JUDGE_KEY", "test-key-123"


def _value(text):
    """A number from "0.333", "12" or "\\frac{1}{3}" (the server's own grading), else None."""
    m = re.fullmatch(r"\\frac\{(-?\d+)\}\{(\d+)\}", text.strip())
    try:
        return Fraction(int(m[1]), int(m[2])) if m else Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        return None


class JudgeServer(BaseHTTPRequestHandler):
    """A judge "model": CORRECT iff the graded answer equals the reference within 1% (what an LLM judge
    accepts and math-verify does not: 0.333 for 1/3). Answers GARBAGE / NOCONTENT / FLAKY / SLOW
    trigger an unparsable reply, a reply without a message, one 503 then a verdict, a slow reply."""

    def log_message(self, *args):  # keep the test output quiet
        pass

    def _send(self, code, payload):
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            return self._send(200, {"object": "list", "data": [{"id": "judge-test", "object": "model"}]})
        self._send(404, {"error": {"message": "not found"}})

    def do_POST(self):
        srv = self.server
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv.requests.append({"path": self.path, "body": req, "auth": self.headers.get("Authorization")})
        if self.path != "/v1/chat/completions":
            return self._send(404, {"error": {"message": "not found"}})
        if self.headers.get("Authorization") != f"Bearer {KEY}":
            return self._send(401, {"error": {"message": "invalid api key"}})
        if req.get("model") != "judge-test":
            return self._send(404, {"error": {"message": f"model {req.get('model')} not found"}})
        user = req["messages"][-1]["content"]
        ref, ans = re.search(r"Reference answer:\n(.*)\n\nFinal answer to grade:\n(.*)\Z", user, re.S).groups()
        if ans == "FLAKY":
            srv.flaky += 1
            if srv.flaky == 1:
                return self._send(503, {"error": {"message": "overloaded"}})
        if ans == "SLOW":
            time.sleep(2.0)
        if ans == "NOCONTENT":
            return self._send(200, {"id": "x", "object": "chat.completion", "choices": []})
        if ans == "GARBAGE":
            content = "The answer looks right to me."
        else:
            a, r = _value(ans), _value(ref)
            ok = ans == "FLAKY" or (a is not None and r is not None and abs(a - r) <= abs(r) / 100)
            content = f"Comparing {ans} with {ref}.\nVERDICT: {'CORRECT' if ok else 'INCORRECT'}"
        self._send(200, {"id": "chatcmpl-1", "object": "chat.completion", "model": "judge-test",
                         "choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": content}}]})


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), JudgeServer)
    srv.requests, srv.flaky = [], 0
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def url(srv):
    return f"http://127.0.0.1:{srv.server_address[1]}"


def dead_url():
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)


@pytest.mark.parametrize("content, verdict", [
    ("VERDICT: CORRECT", True), ("reasoning...\n\nverdict: incorrect\n", False), ("VERDICT: CORRECT.", True),
    ("VERDICT: CORRECT\nwait, no", None), ("CORRECT", None), ("VERDICT: INCORRECT or CORRECT", None),
    ("The answer is correct.", None), ("", None), (None, None), ("VERDICT: PARTIALLY CORRECT", None),
])
def test_verdicts_are_parsed_strictly(content, verdict):
    assert parse_verdict(content) is verdict


def test_endpoint_urls():
    assert chat_completions_url("http://h:8000") == "http://h:8000/v1/chat/completions"
    assert chat_completions_url("http://h:8000/v1/") == "http://h:8000/v1/chat/completions"
    assert chat_completions_url("http://h/v1/chat/completions") == "http://h/v1/chat/completions"
    assert make_judge("math_verify") is None
    with pytest.raises(JudgeError, match="unknown judge"):
        make_judge("gpt")


def test_llm_judge_scores_through_a_real_server(server, key):
    from megatron_s3ac.rollout.rewards import math_reward

    judge = LLMJudge(url(server) + "/v1", "judge-test", api_key_env=KEY_ENV, timeout_s=5, max_retries=2,
                     backoff_s=0.01, concurrency=3)
    judge.check()
    responses = ["so it is \\boxed{0.333}", "\\boxed{0.5}", "\\boxed{GARBAGE}", "", "\\boxed{FLAKY}",
                 "\\boxed{NOCONTENT}", "12"]
    refs = ["\\frac{1}{3}", "\\frac{1}{3}", "1", "1", "7", "1", "12"]
    ok, counts = judge.score(["q"] * len(refs), responses, refs)
    assert ok.tolist() == [True, False, False, False, True, False, True]
    assert counts == {"judge_calls": 6, "judge_unparsable": 2}  # GARBAGE, NOCONTENT; "" is never sent
    posts = [r for r in server.requests if r["path"] == "/v1/chat/completions"]
    assert len(posts) == 7  # 6 answers + one retry of the 503
    assert all(r["auth"] == f"Bearer {KEY}" and r["body"]["temperature"] == 0.0 for r in posts)
    # what the judge is for: math-verify rejects the approximation the judge accepts
    assert math_reward(responses[0], refs[0]) == -1.0


def test_endpoint_down_is_a_clear_error():
    judge = LLMJudge(dead_url(), "judge-test", timeout_s=2, max_retries=1, backoff_s=0.01)
    with pytest.raises(JudgeError, match=r"not reachable .*is the server up"):
        judge.check()
    with pytest.raises(JudgeError, match=r"failed 2 times .* last: ConnectionError"):
        judge.score(["q"], ["\\boxed{1}"], ["1"])


def test_timeout_is_bounded(server, key):
    judge = LLMJudge(url(server), "judge-test", api_key_env=KEY_ENV, timeout_s=0.3, max_retries=1, backoff_s=0.01)
    t0 = time.monotonic()
    with pytest.raises(JudgeError, match=r"failed 2 times \(timeout 0.3 s each\); last: ReadTimeout"):
        judge.score(["q"], ["\\boxed{SLOW}"], ["1"])
    assert time.monotonic() - t0 < 2.0


def test_refusals_stop_at_once_and_the_key_comes_from_the_environment(server, monkeypatch):
    judge = LLMJudge(url(server), "judge-test", api_key_env=KEY_ENV, max_retries=3, backoff_s=0.01)
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(JudgeError, match=f"key variable {KEY_ENV} is not set"):
        judge.score(["q"], ["\\boxed{1}"], ["1"])
    monkeypatch.setenv(KEY_ENV, "wrong")
    with pytest.raises(JudgeError, match="refused the request: HTTP 401"):
        judge.score(["q"], ["\\boxed{1}"], ["1"])
    assert len(server.requests) == 1  # a 401 is not retried
    with pytest.raises(JudgeError, match="must name an environment variable"):
        LLMJudge(url(server), "judge-test", api_key_env="sk-live-abc123")


def _server_rule(text, reference):
    """The server's verdict for a response, computed here independently (final answer = response tail)."""
    a, r = _value(text.strip()), _value(reference)
    return a is not None and abs(a - r) <= abs(r) / 100


def test_evaluate_scores_a_set_with_the_llm_judge(engine, tokenizer, server, key):
    judge = LLMJudge(url(server), "judge-test", api_key_env=KEY_ENV, timeout_s=5, sets=("sums",))
    spec = BenchmarkSpec(arithmetic_rows(12), reward="arithmetic", template="raw")
    report = evaluate(engine, tokenizer, {"sums": spec}, k=4, params=SamplingParams(temperature=1.0, max_new_tokens=2),
                      seed=3, keep_samples=True, judge=judge)
    b = report["benchmarks"]["sums"]
    assert b["judge"] == "llm:judge-test"
    expect = np.array([[_server_rule(t, s["reference"]) for t in s["responses"]] for s in b["samples"]])
    assert np.array_equal(np.array([s["correct"] for s in b["samples"]]), expect)
    assert b["avg_at_k"] == pytest.approx(expect.mean())
    nonempty = sum(bool(t.strip()) for s in b["samples"] for t in s["responses"])
    assert b["judge_calls"] == nonempty == len(server.requests) and b["judge_unparsable"] == 0
    # without the judge the same set is scored by its reward (the judge applies only to named sets)
    plain = evaluate(engine, tokenizer, {"sums": spec}, k=4, params=SamplingParams(temperature=1.0, max_new_tokens=2),
                     seed=3, judge=LLMJudge(url(server), "judge-test", api_key_env=KEY_ENV, sets=("other",)))
    assert plain["benchmarks"]["sums"]["judge"] == "arithmetic" and plain["benchmarks"]["sums"]["judge_calls"] == 0


def test_cli_judge_down_exits_2_before_loading_the_model(tmp_path, capsys):
    from eval_fixtures import EXAMPLES
    from megatron_s3ac.eval.cli import main

    out = tmp_path / "r.json"
    rc = main(["--model", str(tmp_path / "no_model"), "--bench", f"minerva={EXAMPLES}/minerva.jsonl",
               "--judge", "llm", "--judge-url", dead_url(), "--judge-model", "m", "--out", str(out)])
    assert rc == 2 and not out.exists()
    assert "not reachable" in capsys.readouterr().err


def test_trainer_evaluation_checks_the_judge_at_start_up(server, key, pool):
    """s3ac-train's evaluation (eval.judge in the config): a down judge stops the run at start-up; a
    set name the judge lists but the run does not evaluate is refused."""
    from eval_fixtures import EXAMPLES
    from megatron_s3ac.eval.periodic import TrainerEvaluation
    from megatron_s3ac.config import EvalCfg, JudgeCfg

    def build(judge, every=1):
        e = EvalCfg(heldout=False, benchmarks={"minerva": f"{EXAMPLES}/minerva.jsonl"}, judge=judge)
        return TrainerEvaluation(e, default_reward="math", default_max_new_tokens=4, heldout_rows=[],
                                 every_n_steps=every, report_dir=None, reward_pool=lambda: pool)

    with pytest.raises(JudgeError, match="not reachable"):
        build(JudgeCfg(name="llm", url=dead_url(), model="judge-test", sets=["minerva"]))
    build(JudgeCfg(name="llm", url=dead_url(), model="judge-test", sets=["minerva"]), every=0)  # eval off: no check
    with pytest.raises(JudgeError, match=r"names no evaluation set: \['minerv'\]"):
        build(JudgeCfg(name="llm", url=url(server), model="judge-test", api_key_env=KEY_ENV, sets=["minerv"]))
    ev = build(JudgeCfg(name="llm", url=url(server), model="judge-test", api_key_env=KEY_ENV, sets=["minerva"]))
    assert ev.judge.label == "llm:judge-test" and ev.evaluator.judge is ev.judge
    assert build(JudgeCfg()).judge is None  # math_verify: today's path
