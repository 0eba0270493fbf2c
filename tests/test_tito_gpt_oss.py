"""gpt-oss (harmony): the offline o200k vocabulary, the framing reader against openai-harmony, turns.

The vocabulary is written from the bpe-openai wheel, byte-identical to OpenAI's file, and harmony
loads it with no download. The parser reads harmony's framing itself (harmony_reader.py); openai-
harmony is its oracle (tests/harmony_support.py): on completions harmony renders (random mixes of
analysis, preambles, calls with and without a content type, finals, the recipient before or after
the channel) and on hostile text (random framing fragments, mutated and truncated completions) the
reader finds harmony's messages and the parse and reasoning split are the harmony-based ones; a
megabyte parses in linear time. The served turns use the gpt-oss template
(tests/templates/gpt_oss.jinja) over SmolLM2's vocabulary plus harmony's special tokens (the parser
reads the decoded text, so the policy's vocabulary does not matter to it), the scripted engine as
the policy, and the official openai / anthropic clients: reasoning in each dialect's own field,
exact ids, mask 1, `tito audit` clean. The three-turn session in every dialect, stitched to one
branch that keeps the sampled analysis and `<|return|>` the template drops and rewrites, is in
tests/test_tito_parsers_families.py (gpt-oss is one of FAMILIES).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from anthropic import AsyncAnthropic

from miles_env.tito import audit
from miles_env.tito.parsers import Parsers, detect, gpt_oss
from miles_env.tito.parsers.harmony_reader import read
from miles_env.tito.parsers.harmony_vocab import VOCAB_FILE, VOCAB_SHA256, ensure_vocab
from tests.harmony_support import (
    calls_of,
    harmony_messages,
    hostile,
    message_text,
    oracle_parse,
    oracle_reasoning,
    rendered,
    starts_only_between,
)
from tests.harmony_support import completion as _completion
from tests.tito_families import ANSWER, GPT_OSS
from tests.tito_support import TOOLS, Served, check_fidelity, served

CALL = {"command": "ls -la"}
FUNCTIONS: list[Any] = [t["function"] for t in TOOLS]


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
        "from miles_env.tito.parsers.harmony_vocab import ensure_vocab; ensure_vocab(); "
        "from openai_harmony import HarmonyEncodingName as N, load_harmony_encoding as load; "
        "enc = load(N.HARMONY_GPT_OSS); print(enc.encode('<|start|>assistant<|channel|>final', allowed_special='all'))"
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


# -- the framing reader against openai-harmony ------------------------------------------------------


def _agrees_with_harmony(text: str) -> bool:
    """The reader finds harmony's messages, and parse (with and without tools) and, where the oracle's
    split can find message n, the reasoning split are the harmony-based ones; the split is exact."""
    msgs = harmony_messages(text)
    frames = read(text)
    want = None if msgs is None else [(m.channel, m.recipient, message_text(m)) for m in msgs]
    assert want == (None if frames is None else [(f.channel, f.recipient, f.text) for f in frames]), text
    for tools in (tuple(TOOLS), ()):
        (c0, k0), (c1, k1) = oracle_parse(text, tools), gpt_oss.parse(text, tools)
        assert (c0, calls_of(k0)) == (c1, calls_of(k1)), (text, tools)
    got, rest = gpt_oss.reasoning(text)
    assert (got.raw if got else "") + rest == text
    if msgs is not None and not starts_only_between(text, msgs):
        return False
    assert oracle_reasoning(text) == (got, rest), text
    return msgs is not None


def test_the_reader_agrees_with_harmony_on_rendered_completions() -> None:
    texts = [rendered(random.Random(seed)) for seed in range(300)]
    assert all(_agrees_with_harmony(t) for t in texts)
    calls = [t for t in texts if gpt_oss.parse(t, tuple(TOOLS))[1]]
    assert len(calls) > 50 and sum("<|constrain|>" not in t for t in calls) > 10  # the mix is a mix
    assert sum("<|channel|>commentary to=" in t for t in calls) > 10


TWO_CALLS = (
    "<|channel|>analysis<|message|>Plan: ✓ two calls.<|end|><|start|>assistant<|channel|>commentary<|message|>"
    "Listing.<|end|><|start|>assistant to=functions.bash<|channel|>commentary json<|message|>"
    '{"command": "ls"}<|call|><|start|>assistant<|channel|>commentary to=functions.bash <|constrain|>json'
    '<|message|>{"command": "pwd"}'
)


def test_the_reader_agrees_with_harmony_on_hostile_text() -> None:
    read_by_harmony = sum(_agrees_with_harmony(hostile(random.Random(seed))) for seed in range(1500))
    assert 200 < read_by_harmony < 1400  # both kinds, framing harmony reads and framing it rejects
    for cut in range(len(TWO_CALLS) + 1):  # truncated anywhere
        _agrees_with_harmony(TWO_CALLS[:cut])


@pytest.mark.parametrize(
    "text",
    [
        "<|channel|>final<|message|>a <|message|> b<|message|>",  # a stray <|message|> is text
        "<|channel|>final<|message|>x<|end|><|start|><|start|>assistant<|channel|>final<|message|>y",
        "<|channel|>final<|message|>x<|end|><|end|>",  # only <|start|> may follow a stop
        "<|channel|><|channel|>final<|message|>x",  # no channel name
        "<|channel|>final<|channel|>final<|message|>x",  # the second marker is a lone word: a recipient
        "<|channel|>commentary to=functions.bash json extra<|message|>{}",  # a word too many
        "<|start|>assistant<|channel|>final<|message|>x",  # the prompt's header again: a recipient
        "<|channel|>final\x1c<|message|>x",  # not whitespace to harmony
        "<|channel|>final\u3000json<|message|>x",  # whitespace to the channel cut and the trim
        "<|channel|>commentary to=functions.bash\u3000json<|message|>{}",  # not to the split: one word
        "<|channel|>analysis<|message|>a<|end|><|start|>user<|channel|>final<|message|>hi",
        "<|channel|>analysis<|message|>a<|end|><|start|>bash to=x<|channel|>final<|message|>hi",
        "<|channel|>analysis<|message|>a<|call|><|return|>",
        "",
    ],
)
def test_nested_and_duplicated_specials_read_as_harmony_reads_them(text: str) -> None:
    _agrees_with_harmony(text)


def test_a_start_inside_the_reasoning_does_not_move_the_split() -> None:
    """The oracle cuts at the n-th `<|start|>` of the text; the reader at message n's own."""
    text = "<|channel|>analysis<|message|>a<|start|>b<|end|><|start|>assistant<|channel|>final<|message|>c"
    r, rest = gpt_oss.reasoning(text)
    assert r is not None and (r.text, r.trail) == ("a<|start|>b", "<|end|><|start|>assistant")
    assert rest == "<|channel|>final<|message|>c"
    assert gpt_oss.parse(rest) == ("c", ()) and oracle_reasoning(text)[0] != r


def _best(text: str, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        _, rest = gpt_oss.reasoning(text)
        gpt_oss.parse(rest, tuple(TOOLS))
        best = min(best, time.perf_counter() - t0)
    return best


CALL_TURN = '<|channel|>commentary to=functions.bash json<|message|>{"a": 1}<|call|><|start|>assistant'
FINAL = "<|channel|>final<|message|>done"
HUGE: dict[str, Callable[[int], str]] = {  # a shape of hostile completion of about n characters
    "one long answer": lambda n: "<|channel|>final<|message|>" + "é x<|" * (n // 5),
    "many analysis": lambda n: (
        "<|channel|>analysis<|message|>hm<|end|><|start|>assistant" * (n // 52) + FINAL
    ),
    "many calls": lambda n: CALL_TURN * (n // len(CALL_TURN)) + FINAL,
    "a long header": lambda n: "<|channel|>" + "a" * n + " to=functions.bash<|message|>{}",
    "specials": lambda n: "<|start|><|message|><|end|><|call|>" * (n // 40),
    "whitespace": lambda n: "<|channel|>final" + " \u3000\t" * (n // 3) + "json<|message|>x",
}


@pytest.mark.parametrize("shape", sorted(HUGE))
def test_a_megabyte_parses_in_linear_time(shape: str) -> None:
    small, big = HUGE[shape](100_000), HUGE[shape](1_000_000)
    # linear is ~10, quadratic ~100: 40 keeps a loaded machine's noise (31 seen under load 10) apart from both
    assert _best(big) / _best(small) < 40


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
