"""gpt-oss (harmony): the offline o200k vocabulary, openai-harmony's parsing, and turns in all dialects.

The vocabulary is written from the bpe-openai wheel, byte-identical to OpenAI's file, and harmony
loads it with no download. The parser is checked on completions rendered by openai-harmony itself
(the canonical form) and on the family's non-canonical script; what harmony cannot read stays text.
The served turns use the gpt-oss template (tests/templates/gpt_oss.jinja) over SmolLM2's vocabulary
plus harmony's special tokens (the parser re-encodes the decoded text with harmony's own encoding,
so the policy's vocabulary does not matter to it), the scripted engine as the policy, and the
official openai / anthropic clients: reasoning in each dialect's own field, exact ids, mask 1,
`tito audit` clean. The three-turn session in every dialect, stitched to one branch
that keeps the sampled analysis and `<|return|>` the template drops and rewrites, is in
tests/test_tito_parsers_families.py (gpt-oss is one of FAMILIES).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from anthropic import AsyncAnthropic

from miles_env.tito import audit
from miles_env.tito.parsers import Parsers, detect, gpt_oss
from miles_env.tito.parsers.harmony_vocab import VOCAB_FILE, VOCAB_SHA256, ensure_vocab
from tests.tito_families import ANSWER, GPT_OSS
from tests.tito_support import TOOLS, Served, check_fidelity, served

CALL = {"command": "ls -la"}
FUNCTIONS: list[Any] = [t["function"] for t in TOOLS]


def _harmony() -> Any:
    return gpt_oss._encoding()


def _completion(*messages: Any) -> str:
    """Messages rendered by openai-harmony, as a completion: the prompt's `<|start|>assistant` and
    the stop token (`<|call|>` / `<|return|>`, stripped by the proxy) left off."""
    enc = _harmony()
    ids = [t for m in messages for t in enc.render(m)]
    text = enc.decode(ids)
    text = text.removeprefix("<|start|>assistant")
    for stop in ("<|call|>", "<|return|>", "<|end|>"):
        text = text.removesuffix(stop)
    return str(text)


def test_vocab_is_written_offline_byte_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_ENV_CACHE", str(tmp_path))
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", "")
    folder = ensure_vocab()
    path = folder / VOCAB_FILE
    assert folder == tmp_path / "tiktoken" and os.environ["TIKTOKEN_ENCODINGS_BASE"] == str(folder)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == VOCAB_SHA256
    path.write_bytes(b"IQ== 0\n")  # a damaged cache is rewritten, not used
    ensure_vocab()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == VOCAB_SHA256


def test_harmony_loads_the_vocabulary_without_a_download(tmp_path: Path) -> None:
    """A fresh process whose downloads would fail (dead proxy, empty download cache) loads harmony."""
    env = {
        **os.environ,
        "MILES_ENV_CACHE": str(tmp_path / "cache"),
        "TIKTOKEN_RS_CACHE_DIR": str(tmp_path / "no-downloads"),
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "HTTP_PROXY": "http://127.0.0.1:9",
    }
    env.pop("TIKTOKEN_ENCODINGS_BASE", None)
    code = (
        "from miles_env.tito.parsers import gpt_oss; enc = gpt_oss._encoding(); "
        "print(enc.encode('<|start|>assistant<|channel|>final', allowed_special='all'))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [200006, 173781, 200005, 17196]  # o200k_harmony's ids
    assert not any((tmp_path / "no-downloads").glob("*"))


def test_parses_what_harmony_renders() -> None:
    from openai_harmony import Message, Role

    thought = Message.from_role_and_content(Role.ASSISTANT, "Let me look.").with_channel("analysis")
    call = (
        Message.from_role_and_content(Role.ASSISTANT, json.dumps(CALL))
        .with_channel("commentary")
        .with_recipient("functions.bash")
        .with_content_type("<|constrain|>json")
    )
    text = _completion(thought, call)
    reasoning, rest = gpt_oss.reasoning(text)
    assert reasoning is not None and reasoning.text == "Let me look." and reasoning.raw + rest == text
    content, calls = gpt_oss.parse(rest, tuple(TOOLS))
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("bash", CALL)]

    final = Message.from_role_and_content(Role.ASSISTANT, ANSWER).with_channel("final")
    assert Parsers("gpt_oss", "harmony").parse(_completion(thought, final), ()).content == ANSWER


@pytest.mark.parametrize(
    "text",
    [
        GPT_OSS.call.removesuffix("<|call|>"),  # the recipient after the channel, odd spacing
        "<|channel|>analysis<|message|>I should list the files.<|end|><|start|>assistant to=functions.bash"
        '<|channel|>commentary json<|message|>{"command": "ls -la"}',  # the template's order
    ],
)
def test_parses_the_native_call_forms(text: str) -> None:
    p = Parsers("gpt_oss", "harmony").parse(text, tuple(TOOLS))
    assert p.reasoning is not None and p.reasoning.text == "I should list the files."
    assert text.startswith(p.reasoning.raw)
    assert p.content is None and [(c.name, json.loads(c.arguments)) for c in p.tool_calls] == [("bash", CALL)]


def test_a_preamble_is_content_and_reasoning_cut_by_length_is_all_reasoning() -> None:
    text = (
        "<|channel|>commentary<|message|>Listing now.<|end|><|start|>assistant<|channel|>commentary"
        ' to=functions.bash <|constrain|>json<|message|>{"command": "ls -la"}'
    )
    content, calls = gpt_oss.parse(text, tuple(TOOLS))
    assert content == "Listing now." and [c.name for c in calls] == ["bash"]
    cut = "<|channel|>analysis<|message|>I was still thin"
    reasoning, rest = gpt_oss.reasoning(cut)
    assert reasoning is not None and (reasoning.text, rest) == ("I was still thin", "")


@pytest.mark.parametrize(
    "text",
    [
        "<|channel|>final<|mesage|>oops",  # harmony cannot read it
        "Just text, no channels.",
        '<|channel|>commentary to=functions.bash <|constrain|>json<|message|>{"command": "ls -la"',  # bad JSON
        '<|channel|>commentary to=browser.search <|constrain|>json<|message|>{"query": "x"}',  # not a function
    ],
)
def test_what_harmony_cannot_make_a_call_of_stays_text(text: str) -> None:
    p = Parsers("gpt_oss", "harmony").parse(text, tuple(TOOLS))
    assert (p.content, p.tool_calls, p.reasoning) == (text, (), None)


def test_without_tools_a_call_stays_text_and_an_answer_leaves_its_frame() -> None:
    call = GPT_OSS.call.removesuffix("<|call|>")
    p = Parsers("gpt_oss", "harmony").parse(call, ())
    assert p.tool_calls == () and p.reasoning is not None and p.content is not None
    assert p.reasoning.raw + p.content == call
    answer = Parsers("gpt_oss", "harmony").parse(GPT_OSS.answer, ())
    assert (answer.content, answer.reasoning and answer.reasoning.text) == (ANSWER, "Two names.")


def test_the_gpt_oss_template_selects_harmony() -> None:
    assert detect(GPT_OSS.tokenizer()) == ("gpt_oss", "harmony")


# -- served turns, in every dialect -------------------------------------------------------------------

Turn = tuple[str | None, str | None, list[tuple[str, dict[str, Any]]]]  # (reasoning, text, calls)
ANTHROPIC_TOOLS = [
    {"name": f["name"], "description": "Run", "input_schema": f["parameters"]} for f in FUNCTIONS
]


async def _chat(s: Served, sid: str) -> Turn:
    msgs: list[Any] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "list files"},
    ]
    r = await s.client(sid).chat.completions.create(model="policy", messages=msgs, tools=TOOLS)  # type: ignore[arg-type]
    m = r.choices[0].message
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls or []]  # type: ignore[union-attr]
    return getattr(m, "reasoning_content", None), m.content, calls


async def _responses(s: Served, sid: str) -> Turn:
    tools: Any = [{"type": "function", **f} for f in FUNCTIONS]
    r = await s.client(sid).responses.create(model="policy", input="list files", tools=tools)
    think = next((o.summary[0].text for o in r.output if o.type == "reasoning"), None)
    calls = [(o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"]
    text = "".join(
        p.text for o in r.output if o.type == "message" for p in o.content if p.type == "output_text"
    )
    return think, text or None, calls


async def _anthropic(s: Served, sid: str) -> Turn:
    ep = s.proxy.endpoint(sid, s.url)
    a = AsyncAnthropic(base_url=ep.base_url.removesuffix("/v1"), api_key=ep.api_key, max_retries=0)
    try:
        msgs: Any = [{"role": "user", "content": "list files"}]
        r = await a.messages.create(model="policy", max_tokens=256, messages=msgs, tools=ANTHROPIC_TOOLS)  # type: ignore[arg-type]
    finally:
        await a.close()
    think = next((b.thinking for b in r.content if b.type == "thinking"), None)
    text = "".join(b.text for b in r.content if b.type == "text")
    return think, text or None, [(b.name, dict(b.input)) for b in r.content if b.type == "tool_use"]


DIALECTS = {"chat": _chat, "responses": _responses, "anthropic": _anthropic}


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("dialect", sorted(DIALECTS))
@pytest.mark.parametrize("turn", ["call", "answer", "bye"])
async def test_a_turn_in_each_dialect_is_token_exact(turn: str, dialect: str, tmp_path: Path) -> None:
    tok = GPT_OSS.tokenizer()
    engine = GPT_OSS.engine(tok, [getattr(GPT_OSS, turn)])
    async with served(tok, engine, store_dir=tmp_path, stop_token=GPT_OSS.stop) as s:
        assert (s.proxy.parsers.tool, s.proxy.parsers.reasoning) == ("gpt_oss", "harmony")
        h = s.proxy.create_session()
        got = await DIALECTS[dialect](s, h.session_id)
        trajs = s.proxy.export(h.session_id)
    expected: dict[str, Turn] = {
        "call": (GPT_OSS.thoughts[0], None, [("bash", CALL)]),
        "answer": (GPT_OSS.thoughts[1], ANSWER, []),
        "bye": (None, "Bye.", []),
    }
    assert got == expected[turn]
    (call,) = engine.calls
    last = tok.convert_ids_to_tokens(call.generation.output_ids[-1])
    assert last == ("<|call|>" if turn == "call" else "<|return|>")  # the turn ended on harmony's stop
    check_fidelity(trajs, engine, h.session_id)  # every sampled id stored exactly once, mask 1
    assert audit(tmp_path).ok
