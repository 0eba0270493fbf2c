"""Hostile and unlucky requests: bounded bodies, refusals that read like the real APIs, no half-stored turns.

Each test drives a proxy served in a background thread over raw keep-alive connections
(`Raw`), so it can see what the client sees: status, the dialect's error shape, whether the
connection survives, and what was journaled.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from miles_env.engines.scripted import ScriptedEngine
from miles_env.errors import EngineError, EngineRefused
from miles_env.models import load_tokenizer
from miles_env.tito import Budget, TitoProxy
from miles_env.tito.audit import audit
from miles_env.tito.messages import Message
from miles_env.types import Trajectory
from tests.tito_support import ADMIN, Raw, error_shape, strict_json, threaded


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


USER = {"role": "user", "content": "hi"}
# route -> (path under /s/{sid}/v1, dialect, a valid body)
ROUTES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "chat": ("/chat/completions", "openai", {"model": "policy", "messages": [USER]}),
    "responses": ("/responses", "openai", {"model": "policy", "input": "hi"}),
    "messages": ("/messages", "anthropic", {"model": "policy", "max_tokens": 16, "messages": [USER]}),
    "count": ("/messages/count_tokens", "anthropic", {"model": "policy", "messages": [USER]}),
}
CLAUDE_CODE = re.compile(r"prompt is too long[^0-9]*(\d+)\s*tokens?\s*>\s*(\d+)")  # its compaction trigger


def path(sid: str, route: str) -> str:
    return f"/s/{sid}/v1{ROUTES[route][0]}"


def auth(key: str) -> dict[str, str]:
    return {"x-api-key": key, "content-type": "application/json"}


def with_content(route: str, text: str) -> dict[str, Any]:
    body = dict(ROUTES[route][2])
    if route == "responses":
        return body | {"input": text}
    return body | {"messages": [{"role": "user", "content": text}]}


def openai_context_body(n: int, m: int) -> dict[str, Any]:
    message = (
        f"This model's maximum context length is {m} tokens. However, your messages resulted in {n} tokens. "
        "Please reduce the length of the messages."
    )
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }


def anthropic_context_body(n: int, m: int) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": f"prompt is too long: {n} tokens > {m} maximum",
        },
    }


def test_oversized_bodies_are_413_in_each_dialect_and_the_connection_lives(tok, tmp_path: Path) -> None:
    limit = 64 * 1024
    with threaded(tok, store_dir=tmp_path, max_body_bytes=limit) as t:
        h = t.session()
        for route, (_, dialect, ok) in ROUTES.items():
            big = json.dumps(with_content(route, "x" * (limit + 1))).encode()
            with Raw(t.url) as c:
                r = c.request("POST", path(h.session_id, route), big, auth(h.api_key))
                assert r.status == 413, (route, r.body)
                err = error_shape(dialect, r.body)
                assert err["type" if dialect == "anthropic" else "code"] == "request_too_large"
                assert c.alive  # the rest of the body was discarded, the connection kept
                assert (
                    c.request(
                        "POST", path(h.session_id, route), json.dumps(ok).encode(), auth(h.api_key)
                    ).status
                    == 200
                )
                # chunked (no Content-Length): refused once it grows past the limit
                c.head("POST", path(h.session_id, route), None, auth(h.api_key))
                for k in range(0, len(big), 8192):
                    c.data(big[k : k + 8192])
                c.end()
                r = c.response()
                assert r.status == 413 and error_shape(dialect, r.body)
            with Raw(t.url) as c:  # declared far over the limit: answered at once, then closed
                c.head("POST", path(h.session_id, route), 100 * limit, auth(h.api_key))
                r = c.response()
                assert r.status == 413 and r.headers.get("connection") == "close"
        events = [e["kind"] for e in t.journal(h.session_id)]
        assert events.count("turn") == 3  # the three valid generating requests, nothing else


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_huge_prompt_is_refused_from_its_size_without_tokenizing(tok, tmp_path: Path, route: str) -> None:
    with threaded(tok, store_dir=tmp_path) as t:  # ScriptedEngine: max_context 8192
        h = t.session()
        encoded: list[int] = []
        encode = t.proxy.renderer.encode
        t.proxy.renderer.encode = lambda text: encoded.append(len(text)) or encode(text)  # type: ignore[method-assign]
        body = json.dumps(with_content(route, "word " * (8 * 2**20 // 5))).encode()  # 8 MiB
        with Raw(t.url) as c:
            t0 = time.perf_counter()
            r = c.request("POST", path(h.session_id, route), body, auth(h.api_key))
            took = time.perf_counter() - t0
            assert r.status == 400, r.body[:300]
            dialect = ROUTES[route][1]
            err = error_shape(dialect, r.body)
            if dialect == "anthropic":
                n, m = map(int, CLAUDE_CODE.search(err["message"]).groups())  # type: ignore[union-attr]
                assert r.json() == anthropic_context_body(n, m)
            else:
                n = int(re.search(r"resulted in (\d+) tokens", err["message"]).group(1))  # type: ignore[union-attr]
                m = 8192
                assert r.json() == openai_context_body(n, m)
            assert m == 8192 and n >= m  # n: a proven lower bound (the text's bytes / most bytes per token)
            assert max(encoded, default=0) < 2**20  # the prompt was never tokenized
            assert c.alive and c.request("GET", "/health").status == 200
        assert took < 30  # today it took minutes; the bound is loose on purpose (loaded CI machines)
        assert [e["kind"] for e in t.journal(h.session_id)][1:] in ([], ["truncated"])


def test_context_refusals_read_like_the_real_apis(tok, tmp_path: Path) -> None:
    with threaded(tok, store_dir=tmp_path) as t:
        long = "word " * 100
        for route in ("chat", "responses", "messages"):
            h = t.session(budget=Budget(max_context=64))
            with Raw(t.url) as c:
                r = c.request(
                    "POST",
                    path(h.session_id, route),
                    json.dumps(with_content(route, long)).encode(),
                    auth(h.api_key),
                )
            assert r.status == 400
            r_ = t.proxy.renderer
            n = len(r_.encode(r_.render_full((Message("user", long),), ())))
            assert n > 64
            want = anthropic_context_body(n, 64) if route == "messages" else openai_context_body(n, 64)
            assert r.json() == want, route
            assert t.info(h.session_id).truncated == "max_context"
            assert "turn" not in [e["kind"] for e in t.journal(h.session_id)]
        # the official clients see what they key their recovery on
        h = t.session(budget=Budget(max_context=64))
        ep = t.proxy.endpoint(h.session_id, t.url)
        with openai.OpenAI(base_url=ep.base_url, api_key=h.api_key, max_retries=0) as oc:
            with pytest.raises(openai.BadRequestError) as e1:
                oc.chat.completions.create(model="policy", messages=[{"role": "user", "content": long}])
            assert e1.value.code == "context_length_exceeded"
            with pytest.raises(openai.BadRequestError) as e2:
                oc.responses.create(model="policy", input=long)
            assert e2.value.code == "context_length_exceeded"
        with anthropic.Anthropic(base_url=ep.root_url, api_key=h.api_key, max_retries=0) as ac:
            with pytest.raises(anthropic.BadRequestError) as e3:
                ac.messages.create(model="policy", max_tokens=8, messages=[{"role": "user", "content": long}])
        assert CLAUDE_CODE.search(str(e3.value)) is not None


class _Refusing(ScriptedEngine):
    """Failure injection: the engine refuses (deterministic) or fails (transient) on demand."""

    error: Exception | None = None

    async def generate(self, input_ids, sampling, *, session_id=None):
        if self.error is not None:
            raise self.error
        return await super().generate(input_ids, sampling, session_id=session_id)


def test_engine_refusals_are_the_dialects_own_400_and_failures_stay_5xx(tok, tmp_path: Path) -> None:
    engine = _Refusing(tok)
    with threaded(tok, engine, store_dir=tmp_path) as t:
        h = t.session()
        cases: list[tuple[Exception, int, Any]] = [
            (EngineRefused("too long for me", "context_length", 9000, 8191), 400, "context"),
            (EngineRefused("top_k must be -1 or >= 1", "invalid_request"), 400, "invalid"),
            (EngineError("connection reset"), 502, "transient"),
        ]
        with Raw(t.url) as c:
            for error, status, kind in cases:
                engine.error = error
                for route in ("chat", "responses", "messages"):
                    r = c.request(
                        "POST",
                        path(h.session_id, route),
                        json.dumps(ROUTES[route][2]).encode(),
                        auth(h.api_key),
                    )
                    assert r.status == status, (route, kind, r.body)
                    dialect = ROUTES[route][1]
                    err = error_shape(dialect, r.body)
                    if kind == "context":
                        want = (
                            anthropic_context_body(9000, 8191)
                            if dialect == "anthropic"
                            else openai_context_body(9000, 8191)
                        )
                        assert r.json() == want
                    elif kind == "invalid":
                        assert (
                            err["message"] == "top_k must be -1 or >= 1"
                            and err["type"] == "invalid_request_error"
                        )
                    else:
                        assert err["type"] == ("api_error" if dialect == "anthropic" else "server_error")
                    assert c.alive
            engine.error = None
            assert (
                c.request(
                    "POST",
                    path(h.session_id, "chat"),
                    json.dumps(ROUTES["chat"][2]).encode(),
                    auth(h.api_key),
                ).status
                == 200
            )
        kinds = [e["kind"] for e in t.journal(h.session_id)]
        assert kinds == ["session", "truncated", "turn"]  # refusals store no turn; context marks the session


def test_a_response_that_cannot_be_sent_stores_no_turn(tok, tmp_path: Path, monkeypatch) -> None:
    with threaded(tok, store_dir=tmp_path) as t:
        h = t.session()
        with Raw(t.url) as c:
            # a lone surrogate (a valid JSON escape, not valid Unicode) in `model`: refused before generating
            for route in ("chat", "responses", "messages"):
                body = json.dumps(ROUTES[route][2]).replace('"policy"', '"\\ud800"').encode()
                r = c.request("POST", path(h.session_id, route), body, auth(h.api_key))
                assert r.status == 400, r.body
                assert "model" in error_shape(ROUTES[route][1], r.body)["message"]
                assert c.alive
            # a response that fails to serialize after the engine answered: a 500, and no turn
            import miles_env.tito.app as app_mod

            def broken(*a: Any, **k: Any) -> Any:
                raise ValueError("cannot serialize")

            monkeypatch.setattr(app_mod, "completion_body", broken)
            r = c.request(
                "POST", path(h.session_id, "chat"), json.dumps(ROUTES["chat"][2]).encode(), auth(h.api_key)
            )
            assert r.status == 500 and error_shape("openai", r.body)["type"] == "server_error"
            assert c.alive  # a 500 keeps the connection too
            monkeypatch.undo()
            assert t.journal(h.session_id)[1:] == []
            assert (
                c.request(
                    "POST",
                    path(h.session_id, "chat"),
                    json.dumps(ROUTES["chat"][2]).encode(),
                    auth(h.api_key),
                ).status
                == 200
            )
        assert [e["kind"] for e in t.journal(h.session_id)] == ["session", "turn"]


def test_generated_tool_calls_that_are_not_strict_json_stay_text(tok, tmp_path: Path) -> None:
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    replies = [
        '<tool_call>\n{"name": "bash", "arguments": {"command": "\\ud800"}}\n</tool_call>',
        '<tool_call>\n{"name": "bash", "arguments": {"n": NaN}}\n</tool_call>',
    ]
    with threaded(tok, ScriptedEngine(tok, replies), store_dir=tmp_path) as t:
        h = t.session()
        for route in ("chat", "messages"):
            body = dict(ROUTES[route][2])
            body["tools"] = (
                tools if route == "chat" else [{"name": "bash", "input_schema": {"type": "object"}}]
            )
            with Raw(t.url) as c:
                r = c.request("POST", path(h.session_id, route), json.dumps(body).encode(), auth(h.api_key))
            assert r.status == 200, r.body
            text = json.dumps(r.json())
            assert "tool_use" not in text and "tool_calls" not in text  # kept as content, not a call
        assert t.info(h.session_id).n_turns == 2
        t.call(t.proxy.export, h.session_id)
        assert audit(tmp_path).ok


class _MinusInf(ScriptedEngine):
    """An engine that reports -inf and NaN logprobs (zero-probability and broken tokens)."""

    async def generate(self, input_ids, sampling, *, session_id=None):
        g = await super().generate(input_ids, sampling, session_id=session_id)
        lps = [float("-inf"), float("nan"), *g.logprobs[2:]][: len(g.logprobs)]
        return dataclasses.replace(g, logprobs=lps)


def test_non_finite_logprobs_are_strict_json_everywhere_and_round_trip(tok, tmp_path: Path) -> None:
    engine = _MinusInf(tok, ["three token reply", "again more words"])
    with threaded(tok, engine, store_dir=tmp_path) as t:
        h = t.session()
        with Raw(t.url) as c:
            r = c.request(
                "POST", path(h.session_id, "chat"), json.dumps(ROUTES["chat"][2]).encode(), auth(h.api_key)
            )
            assert r.status == 200
            r = c.request(
                "GET",
                f"/admin/sessions/{h.session_id}/trajectory",
                headers={"authorization": f"Bearer {ADMIN}"},
            )
            assert r.status == 200, r.body
            (branch,) = r.json()["branches"]  # strict JSON: "-Infinity" / "NaN" sentinels
            start = branch["turns"][0]["start"]
            assert branch["logprobs"][start : start + 2] == ["-Infinity", "NaN"]
            lps = Trajectory.model_validate(branch).logprobs
            assert lps[start] == float("-inf") and lps[start + 1] != lps[start + 1]
        for line in (tmp_path / f"{h.session_id}.jsonl").read_bytes().splitlines():
            strict_json(line)
        strict_json((tmp_path / f"{h.session_id}.export.json").read_bytes())
    report = audit(tmp_path)
    assert report.ok and report.snapshots == 1, report.drifts
    reloaded = TitoProxy(ScriptedEngine(tok), tok, store_dir=tmp_path)
    (traj,) = reloaded.export(h.session_id)
    assert traj.logprobs[start] == float("-inf") and traj.logprobs[start + 1] != traj.logprobs[start + 1]
    assert audit(tmp_path).ok


def test_a_slow_client_is_timed_out_in_its_dialect(tok, tmp_path: Path) -> None:
    with threaded(tok, store_dir=tmp_path, body_timeout_s=0.5) as t:
        h = t.session()
        for route in ("chat", "messages"):
            with Raw(t.url, timeout=20) as c:
                c.head("POST", path(h.session_id, route), 1000, auth(h.api_key))
                c.data(b'{"messages": [')  # ... and then nothing more
                r = c.response()
                assert r.status == 408 and r.headers.get("connection") == "close"
                error_shape(ROUTES[route][1], r.body)
        with Raw(t.url) as c:
            assert (
                c.request(
                    "POST",
                    path(h.session_id, "chat"),
                    json.dumps(ROUTES["chat"][2]).encode(),
                    auth(h.api_key),
                ).status
                == 200
            )


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_client_that_hangs_up_is_one_log_line(tok, tmp_path: Path) -> None:
    engine = ScriptedEngine(tok, ["word " * 300])
    with threaded(tok, engine, store_dir=tmp_path) as t:
        h = t.session()
        seen = _Records()
        loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "miles_env.tito")]
        levels = [lg.level for lg in loggers]
        for lg in loggers:
            lg.addHandler(seen)
            lg.setLevel(logging.INFO)
        try:
            with Raw(t.url) as c:  # hangs up halfway through its request body
                c.head("POST", path(h.session_id, "chat"), 1000, auth(h.api_key))
                c.data(b'{"messages": [')
            _wait_for(lambda: _hung_up(seen) == 1)
            with Raw(t.url) as c:  # hangs up after the first bytes of a stream
                body = json.dumps(ROUTES["chat"][2] | {"stream": True}).encode()
                c.head("POST", path(h.session_id, "chat"), len(body), auth(h.api_key))
                c.data(body)
                c.end()
                c.sock.recv(64)
            _wait_for(lambda: t.info(h.session_id).n_turns == 1)
            time.sleep(0.3)
        finally:
            for lg, level in zip(loggers, levels, strict=True):
                lg.removeHandler(seen)
                lg.setLevel(level)
        assert _hung_up(seen) in (1, 2)  # the stream's hang-up may go unnoticed (its bytes were sent)
        assert not [r for r in seen.records if r.exc_info], [r.getMessage() for r in seen.records]
        assert all("\n" not in r.getMessage() for r in seen.records)
        assert t.info(h.session_id).n_turns == 1  # the streamed turn was kept


def _hung_up(seen: _Records) -> int:
    return len([r for r in seen.records if "hung up" in r.getMessage()])


def _wait_for(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_a_template_that_refuses_the_messages_is_a_400(tok, tmp_path: Path) -> None:
    strict = copy.deepcopy(tok)  # a template with its own checks (Llama- and Mistral-style role order)
    strict.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
        "{{ raise_exception('System message must be first') }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with threaded(strict, store_dir=tmp_path) as t:
        h = t.session()
        late = {"messages": [USER, {"role": "system", "content": "late"}]}
        with Raw(t.url) as c:
            r = c.request("POST", path(h.session_id, "chat"), json.dumps(late).encode(), auth(h.api_key))
            assert (
                r.status == 400 and "System message must be first" in error_shape("openai", r.body)["message"]
            )
            ok = c.request(
                "POST", path(h.session_id, "chat"), json.dumps(ROUTES["chat"][2]).encode(), auth(h.api_key)
            )
            assert ok.status == 200
        assert [e["kind"] for e in t.journal(h.session_id)] == ["session", "turn"]
