"""Bounded, seeded fuzzing of every dialect route, plus a table of known-hostile requests.

One proxy (ScriptedEngine, a store) serves the whole module from a background thread.
For every request: no 5xx, an error body in the route's dialect shape, nothing journaled
on a 4xx (a context refusal may only add the session's `truncated` marker), and the
keep-alive connection still usable. At the end the official openai and anthropic clients
run a normal session on each dialect and `tito audit` finds the store clean.
Hypothesis runs derandomized (`derandomize=True`), so every CI run sends the same bodies.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterator
from typing import Any
from unittest import mock

import anthropic
import openai
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from miles_env.engines.scripted import ScriptedEngine
from miles_env.models import load_tokenizer
from miles_env.tito import messages
from miles_env.tito.audit import audit
from miles_env.tito.messages import Message, message_key_v1
from miles_env.tito.render import Renderer
from tests.tito_support import Raw, Reply, Threaded, error_shape, threaded

FUZZ = settings(
    max_examples=120,
    derandomize=True,
    deadline=None,
    # one session and connection per test function on purpose: state carries over between examples
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
ROUTES = {  # name -> (path under /s/{sid}/v1, dialect)
    "chat": ("/chat/completions", "openai"),
    "responses": ("/responses", "openai"),
    "messages": ("/messages", "anthropic"),
    "count": ("/messages/count_tokens", "anthropic"),
}
OK = {
    "chat": {"model": "policy", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    "responses": {"model": "policy", "max_output_tokens": 4, "input": "hi"},
    "messages": {"model": "policy", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    "count": {"model": "policy", "messages": [{"role": "user", "content": "hi"}]},
}


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer()


@pytest.fixture(scope="module")
def server(tok: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Threaded]:
    store = tmp_path_factory.mktemp("fuzz") / "sessions"
    with threaded(tok, ScriptedEngine(tok), store_dir=store, body_timeout_s=1.0) as t:
        yield t


class Client:
    """One session and one keep-alive connection; `send` checks every invariant of the module note."""

    def __init__(self, t: Threaded, route: str) -> None:
        self.t, self.route = t, route
        self.path, self.dialect = ROUTES[route]
        h = t.session()
        self.sid, self.key = h.session_id, h.api_key
        self.raw = Raw(t.url)

    def url(self) -> str:
        return f"/s/{self.sid}/v1{self.path}"

    def send(
        self, body: bytes, method: str = "POST", path: str | None = None, extra: dict[str, str] | None = None
    ) -> Reply:
        before = self.t.journal(self.sid)
        headers = {"x-api-key": self.key, "content-type": "application/json", **(extra or {})}
        r = self.raw.request(method, path or self.url(), body, headers)
        assert r.status < 500, (self.route, body[:300], r.body[:500])
        if r.status >= 400:
            err = error_shape(self.dialect, r.body)
            after = self.t.journal(self.sid)
            added = [e["kind"] for e in after[len(before) :]]
            code = err.get("code") or ("context_length_exceeded" if "too long" in err["message"] else None)
            assert added == [] or (code == "context_length_exceeded" and added == ["truncated"]), (added, err)
        else:
            assert r.status == 200
            if "json" in r.headers.get("content-type", ""):
                r.json()  # strict JSON
        assert self.raw.alive, (self.route, r.status, r.headers)
        return r

    def close(self) -> None:
        self.raw.close()


@pytest.fixture
def clients(server: Threaded) -> Iterator[dict[str, Client]]:
    cs = {name: Client(server, name) for name in ROUTES}
    yield cs
    for c in cs.values():
        c.close()


# -- strategies ------------------------------------------------------------------------------------
TEXT = st.text(st.characters(codec="utf-8"), max_size=40)
LEAF = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT
)
JSON = st.recursive(
    LEAF, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(TEXT, kids, max_size=4), max_leaves=12
)


def either(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly the well-typed value, sometimes any JSON at all."""
    return st.one_of(*[good] * 7, JSON)


def mostly(good: st.SearchStrategy[Any], wild: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(good, good, wild)


def bodies(fields: dict[str, st.SearchStrategy[Any]], required: tuple[str, ...]) -> st.SearchStrategy[Any]:
    """Objects with the route's fields (each well-typed or not, required ones sometimes missing), or any JSON."""
    req = {k: either(v) for k, v in fields.items() if k in required}
    opt = {k: either(v) for k, v in fields.items() if k not in required}
    obj = st.fixed_dictionaries(req, optional=opt)
    return st.one_of(obj, obj, obj, obj, st.fixed_dictionaries({}, optional={**req, **opt}), JSON)


WORDS = st.text(st.sampled_from("abc xyz\n"), min_size=1, max_size=20)
ROLE = st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard"])
PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_text", "tool_result", "tool_use", "thinking"])},
    optional={
        "text": TEXT,
        "id": TEXT,
        "name": TEXT,
        "input": JSON,
        "tool_use_id": TEXT,
        "content": TEXT,
        "signature": TEXT,
    },
)
CONTENT = TEXT | st.lists(either(PART), max_size=3)
CALL = st.fixed_dictionaries(
    {
        "id": TEXT,
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": TEXT, "arguments": TEXT | JSON.map(json.dumps)}),
    }
)
CHAT_MSG = mostly(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": WORDS}),
    st.fixed_dictionaries(
        {"role": ROLE, "content": either(CONTENT)},
        optional={"tool_calls": st.lists(either(CALL), max_size=2), "tool_call_id": TEXT, "name": TEXT},
    ),
)
FN_TOOL = st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": TEXT, "parameters": JSON})}
)
SAMPLING = {
    "temperature": mostly(st.floats(0, 1), st.floats(-1, 3, allow_nan=False)),
    "top_p": mostly(st.floats(0.1, 1), st.floats(-1, 2, allow_nan=False)),
    "stream": st.booleans(),
    "model": TEXT,
}
CHAT = bodies(
    {
        "messages": st.lists(either(CHAT_MSG), min_size=1, max_size=4),
        "tools": st.lists(either(FN_TOOL), max_size=2),
        "max_tokens": mostly(st.integers(1, 6), st.integers(-2, 0)),
        "stop": TEXT | st.lists(TEXT, max_size=2),
        "n": mostly(st.just(1), st.integers(0, 3)),
        **SAMPLING,
    },
    ("messages",),
)
ITEM = mostly(
    st.fixed_dictionaries({"role": st.sampled_from(["developer", "user", "assistant"]), "content": WORDS}),
    st.one_of(
        st.fixed_dictionaries(
            {"role": ROLE, "content": either(CONTENT)}, optional={"type": st.just("message"), "id": TEXT}
        ),
        st.fixed_dictionaries(
            {"type": st.just("function_call"), "call_id": TEXT, "name": TEXT, "arguments": TEXT}
        ),
        st.fixed_dictionaries(
            {"type": st.just("custom_tool_call"), "call_id": TEXT, "name": TEXT, "input": TEXT}
        ),
        st.fixed_dictionaries(
            {
                "type": st.sampled_from(["function_call_output", "custom_tool_call_output"]),
                "call_id": TEXT,
                "output": TEXT,
            }
        ),
        st.fixed_dictionaries(
            {"type": st.just("reasoning")}, optional={"encrypted_content": TEXT, "summary": JSON}
        ),
    ),
)
RESP_TOOL = st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "custom", "web_search"]), "name": TEXT},
    optional={"parameters": JSON, "description": TEXT},
)
RESPONSES = bodies(
    {
        "input": WORDS | st.lists(either(ITEM), min_size=1, max_size=4),
        "instructions": TEXT,
        "tools": st.lists(either(RESP_TOOL), max_size=2),
        "max_output_tokens": mostly(st.integers(1, 6), st.integers(-2, 0)),
        "previous_response_id": st.none() | TEXT,
        **SAMPLING,
    },
    ("input",),
)
BLOCK = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image"])},
    optional={
        "text": TEXT,
        "id": TEXT,
        "name": TEXT,
        "input": JSON,
        "tool_use_id": TEXT,
        "content": TEXT | st.lists(either(PART), max_size=2),
        "is_error": st.booleans(),
        "thinking": TEXT,
        "signature": TEXT,
        "cache_control": JSON,
    },
)
TEXT_BLOCK = st.fixed_dictionaries({"type": st.just("text"), "text": WORDS}, optional={"cache_control": JSON})
A_MSG = mostly(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant"]),
            "content": WORDS | st.lists(TEXT_BLOCK, min_size=1, max_size=2),
        }
    ),
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system", "tool"]),
            "content": TEXT | st.lists(either(BLOCK), max_size=3),
        }
    ),
)
A_TOOL = st.fixed_dictionaries(
    {"name": TEXT},
    optional={
        "type": st.sampled_from(["custom", "bash_20250124"]),
        "input_schema": JSON,
        "description": TEXT,
    },
)
A_FIELDS = {
    "messages": st.lists(either(A_MSG), min_size=1, max_size=4),
    "system": TEXT | st.lists(either(BLOCK), max_size=2),
    "tools": st.lists(either(A_TOOL), max_size=2),
    "model": TEXT,
}
MESSAGES = bodies(
    {
        **A_FIELDS,
        "max_tokens": mostly(st.integers(1, 6), st.integers(-2, 0)),
        "stop_sequences": st.lists(TEXT, max_size=2),
        "temperature": mostly(st.floats(0, 1), st.floats(-1, 2, allow_nan=False)),
        "top_k": st.integers(-2, 5),
        "stream": st.booleans(),
        "output_config": JSON,
    },
    ("messages", "max_tokens"),
)
COUNT = bodies(A_FIELDS, ("messages",))
# well-formed bodies (a third of the examples): these must be served (200) and stored
GOOD_TOOL = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["bash", "f"]), "parameters": st.just({"type": "object"})}
        ),
    }
)
GOOD_SAMPLING = {
    "model": TEXT,
    "temperature": st.floats(0, 1),
    "top_p": st.floats(0.1, 1),
    "stream": st.booleans(),
}
CHAT_OK = st.fixed_dictionaries(
    {
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["system", "user", "assistant"]), "content": WORDS}
            ),
            min_size=1,
            max_size=4,
        )
    },
    optional={
        "max_tokens": st.integers(1, 6),
        "stop": WORDS,
        "tools": st.lists(GOOD_TOOL, max_size=2),
        **GOOD_SAMPLING,
    },
)
RESPONSES_OK = st.fixed_dictionaries(
    {
        "input": WORDS
        | st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["developer", "user", "assistant"]), "content": WORDS}
            ),
            min_size=1,
            max_size=4,
        )
    },
    optional={"instructions": WORDS, "max_output_tokens": st.integers(1, 6), **GOOD_SAMPLING},
)
A_MSGS_OK = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant"]),
            "content": WORDS | st.lists(TEXT_BLOCK, min_size=1, max_size=2),
        }
    ),
    min_size=1,
    max_size=4,
)
MESSAGES_OK = st.fixed_dictionaries(
    {"messages": A_MSGS_OK, "max_tokens": st.integers(1, 6)},
    optional={"system": WORDS, "stop_sequences": st.lists(WORDS, max_size=2), **GOOD_SAMPLING},
)
COUNT_OK = st.fixed_dictionaries({"messages": A_MSGS_OK}, optional={"system": WORDS, "model": TEXT})
RAW = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"", b"{", b"null", b"[]", b'"x"', b"NaN", b"{}", b"\xef\xbb\xbf{}"]),
)


def _post(c: Client, data: Any) -> None:
    c.send(data if isinstance(data, bytes) else json.dumps(data).encode())


@FUZZ
@given(body=st.one_of(CHAT_OK, CHAT, CHAT, RAW))
@example(body={"messages": [{"role": "user", "content": "x"}], "n": 2})
def test_fuzz_chat_completions(clients: dict[str, Client], body: Any) -> None:
    _post(clients["chat"], body)


@FUZZ
@given(body=st.one_of(RESPONSES_OK, RESPONSES, RESPONSES, RAW))
def test_fuzz_responses(clients: dict[str, Client], body: Any) -> None:
    _post(clients["responses"], body)


@FUZZ
@given(body=st.one_of(MESSAGES_OK, MESSAGES, MESSAGES, RAW))
@example(body={"max_tokens": 4, "messages": [{"role": "user", "content": []}]})
@example(body={"max_tokens": 4, "messages": [{"role": "assistant", "content": []}]})
@example(
    body={
        "max_tokens": 4,
        "messages": [{"role": "assistant", "content": []}],
        "output_config": {"format": {"type": "json_schema"}},
    }
)
def test_fuzz_messages(clients: dict[str, Client], body: Any) -> None:
    _post(clients["messages"], body)


@FUZZ
@given(body=st.one_of(COUNT_OK, COUNT, COUNT, RAW))
@example(body={"messages": [{"role": "assistant", "content": []}]})
def test_fuzz_count_tokens(clients: dict[str, Client], body: Any) -> None:
    _post(clients["count"], body)


# -- the hostile table -----------------------------------------------------------------------------
def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _with(route: str, **over: Any) -> bytes:
    return json.dumps(OK[route] | over).encode()


def _content(route: str, text_json: str) -> bytes:
    """OK[route] with the user content given as raw JSON text (so it can hold any escape)."""
    if route == "responses":
        return json.dumps(OK[route] | {"input": "@@"}).encode().replace(b'"@@"', text_json.encode())
    body = OK[route] | {"messages": [{"role": "user", "content": "@@"}]}
    return json.dumps(body).encode().replace(b'"@@"', text_json.encode())


def _tool_args(route: str, args_json: str) -> bytes:
    """A history whose assistant tool call carries `args_json` (raw JSON text) as its arguments."""
    if route == "chat":
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "@@"}}
        msgs = [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "r"},
        ]
        body = json.dumps(OK[route] | {"messages": msgs})
        return body.replace('"@@"', json.dumps(args_json)).encode()
    if route == "responses":
        items = [
            {"role": "user", "content": "a"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "@@"},
            {"type": "function_call_output", "call_id": "c1", "output": "r"},
        ]
        return json.dumps(OK[route] | {"input": items}).replace('"@@"', json.dumps(args_json)).encode()
    use = {"type": "tool_use", "id": "c1", "name": "f", "input": "@@"}
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "r"}]},
    ]
    return json.dumps(OK[route] | {"messages": msgs}).replace('"@@"', args_json).encode()


REASONING = {  # what our opaque reasoning field may decode to (a client could forge any of it)
    "lone surrogate": '["", "\\ud800", ""]',
    "deep": _nested(5000),
    "not three strings": "[1, 2, 3]",
}


def _reasoning(route: str, payload: str) -> bytes:
    """A history whose assistant turn carries our reasoning codec's field with `payload` inside."""
    opaque = "tito1:" + base64.b64encode(payload.encode()).decode()
    if route == "responses":
        items = [
            {"role": "user", "content": "a"},
            {"type": "reasoning", "encrypted_content": opaque, "summary": []},
        ]
        items += [{"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
        return json.dumps(OK[route] | {"input": items}).encode()
    if route in ("messages", "count"):
        think = {"type": "thinking", "thinking": "t", "signature": opaque}
        msgs = [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": [think, {"type": "text", "text": "b"}]},
        ]
        return json.dumps(OK[route] | {"messages": [*msgs, {"role": "user", "content": "c"}]}).encode()
    return _with(route)


HOSTILE: list[tuple[str, Any]] = [
    ("8 MiB prompt", lambda r: _content(r, json.dumps("word " * (8 * 2**20 // 5)))),
    *[(f"{d}-level nested body", lambda r, d=d: _nested(d).encode()) for d in (50, 1000, 100_000)],
    *[(f"{d}-level nested content", lambda r, d=d: _content(r, _nested(d))) for d in (50, 1000, 100_000)],
    *[
        (f"{d}-level nested tool args", lambda r, d=d: _tool_args(r, '{"a": ' + _nested(d) + "}"))
        for d in (50, 1000, 100_000)
    ],
    ("lone surrogate in model", lambda r: json.dumps(OK[r]).replace('"policy"', '"\\udc80"').encode()),
    ("lone surrogate in content", lambda r: _content(r, '"a\\ud800b"')),
    ("surrogate pair in content", lambda r: _content(r, '"\\ud83d\\ude00"')),
    ("lone surrogate in tool args", lambda r: _tool_args(r, '{"a": "\\ud800"}')),
    ("lone surrogate inside args text", lambda r: _tool_args(r, '{"a": "\\\\ud800"}')),
    ("surrogate as raw UTF-8 bytes", lambda r: _content(r, '"@"').replace(b"@", b"\xed\xa0\x80")),
    ("invalid UTF-8", lambda r: _content(r, '"@"').replace(b"@", b"\xff\xfe")),
    ("NaN", lambda r: _with(r).replace(b"}", b', "temperature": NaN}', 1)),
    ("1e400", lambda r: _with(r).replace(b"}", b', "temperature": 1e400}', 1)),
    ("5000-digit int", lambda r: _with(r).replace(b"}", b', "max_tokens": ' + b"9" * 5000 + b"}", 1)),
    ("NaN in tool args", lambda r: _tool_args(r, '{"a": NaN}')),
    ("empty content list", lambda r: _content(r, "[]")),
    ("empty body", lambda r: b""),
    ("null body", lambda r: b"null"),
    ("array body", lambda r: b"[1, 2]"),
    ("a million values", lambda r: _content(r, "[" + ",".join(["0"] * 1_000_000) + "]")),
    (
        "200k bad messages",
        lambda r: json.dumps({"messages": [0] * 200_000, "input": [0] * 200_000, "max_tokens": 4}).encode(),
    ),
    *[(f"reasoning payload: {n}", lambda r, p=p: _reasoning(r, p)) for n, p in REASONING.items()],
]


@pytest.mark.parametrize("route", list(ROUTES))
def test_hostile_requests(clients: dict[str, Client], route: str) -> None:
    c = clients[route]
    statuses = {}
    for name, make in HOSTILE:
        statuses[name] = c.send(make(route)).status
    assert statuses["8 MiB prompt"] == 400
    for name in (
        "1000-level nested body",
        "100000-level nested body",
        "lone surrogate in model",
        "lone surrogate in content",
        "invalid UTF-8",
        "NaN",
        "1e400",
        "5000-digit int",
        "surrogate as raw UTF-8 bytes",
    ):
        assert statuses[name] == 400, (name, statuses[name])
    if route == "messages":
        assert statuses["empty content list"] == 400


@pytest.mark.parametrize("route", list(ROUTES))
def test_wrong_methods_and_unknown_routes_answer_in_the_dialect(
    clients: dict[str, Client], route: str
) -> None:
    c = clients[route]
    for method in ("GET", "PUT", "DELETE", "PATCH"):
        r = c.send(b"", method=method)
        assert r.status == 405 and "POST" in r.headers["allow"]
    r = c.send(b"{}", path=c.url() + "/nope")
    assert r.status == 404
    for path, want in ((f"/s/{c.sid}/v1/nope", "openai"), ("/v2/chat", "openai")):
        c.dialect = want
        assert c.send(b"{}", path=path).status == 404
    c.dialect = "anthropic"  # unknown routes answer in Anthropic's shape to Anthropic's clients
    assert c.send(b"{}", path=f"/s/{c.sid}/v1/nope", extra={"anthropic-version": "2023-06-01"}).status == 404
    c.dialect = ROUTES[route][1]


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_slow_client_gets_a_408_in_its_dialect(server: Threaded, route: str) -> None:
    h = server.session()
    with Raw(server.url, timeout=20) as raw:
        raw.head("POST", f"/s/{h.session_id}/v1{ROUTES[route][0]}", 500, {"x-api-key": h.api_key})
        raw.data(b'{"model": "policy", "mess')
        r = raw.response()
    assert r.status == 408 and r.headers["connection"] == "close"
    error_shape(ROUTES[route][1], r.body)
    assert server.journal(h.session_id)[1:] == []


# -- pieces the fuzzing relies on ------------------------------------------------------------------
@pytest.fixture(scope="module")
def renderer(tok: Any) -> Renderer:
    return Renderer(tok)


@settings(max_examples=200, derandomize=True, deadline=None)
@example("\x16" * 100 + "a")  # bytes with no symbol in SmolLM2's vocabulary yield no token
@example(" " * 5000)
@given(
    st.text(st.characters(codec="utf-8"), max_size=400)
    | st.text(st.sampled_from(" \n\t#=-ab<|im_end|>é한"), max_size=600)
)
def test_the_size_bound_never_exceeds_the_token_count(renderer: Renderer, text: str) -> None:
    assert renderer.size_bound is not None and renderer.size_bound.bytes_per_token == 81
    assert len(renderer.encode(text)) >= renderer.min_tokens(text)


@settings(max_examples=100, derandomize=True, deadline=None)
@given(st.text(st.characters(codec="utf-8"), max_size=300), st.integers(1, 40), st.integers(1, 64))
def test_scheme_1_message_keys_of_long_texts_are_unchanged(text: str, reps: int, chunk: int) -> None:
    big = text * reps
    legacy = hashlib.blake2b(json.dumps(["user", big, None], ensure_ascii=False).encode(), digest_size=16)
    with mock.patch.object(messages, "_CHUNK", chunk):  # long strings are hashed in slices of `chunk`
        assert message_key_v1(Message("user", big)) == legacy.hexdigest()  # keys in old journals


def test_after_the_fuzz_every_dialect_still_works_and_audit_is_clean(server: Threaded) -> None:
    h = server.session()
    ep = server.proxy.endpoint(h.session_id, server.url)
    with openai.OpenAI(base_url=ep.base_url, api_key=h.api_key, max_retries=0) as oc:
        msgs: list[Any] = [{"role": "user", "content": "hello"}]
        r1 = oc.chat.completions.create(model="policy", messages=msgs)
        msgs += [
            {"role": "assistant", "content": r1.choices[0].message.content},
            {"role": "user", "content": "more"},
        ]
        r2 = oc.chat.completions.create(model="policy", messages=msgs)
        assert r2.usage is not None and r2.usage.prompt_tokens_details is not None
        assert r2.usage.prompt_tokens_details.cached_tokens > 0
        resp = oc.responses.create(model="policy", input="hello")
        assert resp.output_text == "OK"
    with anthropic.Anthropic(base_url=ep.root_url, api_key=h.api_key, max_retries=0) as ac:
        m = ac.messages.create(model="policy", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        assert m.content[0].type == "text" and m.content[0].text == "OK"
        n = ac.messages.count_tokens(model="policy", messages=[{"role": "user", "content": "hi"}])
        assert n.input_tokens > 0
    for sid in server.call(server.proxy.session_ids):
        server.call(server.proxy.export, sid)
    assert server.store is not None
    report = audit(server.store)
    assert report.ok and report.turns >= 4, report.drifts
