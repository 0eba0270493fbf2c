"""openai-harmony as the oracle for the gpt-oss parser (a helpers module, not a test module).

The runtime reads harmony's framing itself (tito/parsers/harmony_reader.py); openai-harmony stays
the reference here. `harmony_messages` is what the runtime once ran: the text re-encoded with
harmony's o200k encoding (offline vocabulary, harmony_vocab.py) and read by
`parse_messages_from_completion_tokens`; `oracle_parse` / `oracle_reasoning` are the parser built on
it (as of bench/results/parsers.md's 2.78x run, without its one-slot hand-off, which only ever
skipped a re-parse of the same rest). `completion` renders messages with harmony itself; `rendered`
and `hostile` draw random completions of both kinds for the differential test.
"""

from __future__ import annotations

import json
import random
from functools import cache
from typing import Any

from miles_env.tito.messages import ToolCall
from miles_env.tito.parsers.base import Calls, Reasoning, Tools, json_call
from miles_env.tito.parsers.harmony_vocab import ensure_vocab

__all__ = [
    "encoding",
    "harmony_messages",
    "oracle_parse",
    "oracle_reasoning",
    "completion",
    "rendered",
    "hostile",
    "starts_only_between",
    "message_text",
    "calls_of",
]

_START, _ROLE, _MESSAGE, _END, _CHANNEL = "<|start|>", "assistant", "<|message|>", "<|end|>", "<|channel|>"


@cache
def encoding() -> Any:
    """openai-harmony's gpt-oss encoding, loaded once from the offline vocabulary."""
    ensure_vocab()
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def harmony_messages(text: str) -> list[Any] | None:
    """The completion's harmony messages (openai_harmony.Message), or None if harmony cannot parse it."""
    from openai_harmony import Role

    enc = encoding()
    try:
        ids = enc.encode(text, allowed_special="all", disallowed_special=())
        return list(enc.parse_messages_from_completion_tokens(ids, Role.ASSISTANT))
    except Exception:  # HarmonyError: not harmony, so plain text
        return None


def message_text(message: Any) -> str:
    return "".join(getattr(c, "text", "") for c in message.content)


def starts_only_between(text: str, msgs: list[Any]) -> bool:
    """Whether every `<|start|>` of the text opens a message (none stands in a header or a text): only
    then does the oracle's split (the n-th `<|start|>`) find message n."""
    return text.count(_START) == len(msgs) - 1


def _nth_start(text: str, n: int) -> int:
    pos = -1
    for _ in range(n):
        pos = text.index(_START, pos + 1)
    end = pos + len(_START)
    return end + len(_ROLE) if text.startswith(_ROLE, end) else end


def oracle_reasoning(text: str) -> tuple[Reasoning | None, str]:
    """The leading analysis messages as one exact Reasoning, split where the n-th `<|start|>` is."""
    msgs = harmony_messages(text)
    if not msgs or msgs[0].channel != "analysis":
        return None, text
    n = next((i for i, m in enumerate(msgs) if m.channel != "analysis"), len(msgs))
    split = len(text) if n == len(msgs) else _nth_start(text, n)
    region, rest = text[:split], text[split:]
    a = region.index(_MESSAGE) + len(_MESSAGE)
    b = region.rfind(_END)
    b = b if b >= a else len(region)
    return Reasoning(region[:a], region[a:b], region[b:]), rest


def _call(message: Any) -> ToolCall | None:
    recipient = message.recipient or ""
    if not recipient.startswith("functions."):
        return None
    return json_call(recipient[len("functions.") :], message_text(message))


def oracle_parse(text: str, tools: Tools = ()) -> tuple[str | None, Calls]:
    """Content and function calls from harmony's messages; the whole text when harmony cannot read it."""
    msgs = harmony_messages(text)
    if msgs is None:
        return text, ()
    calls: list[ToolCall] = []
    said: list[str] = []
    for m in msgs:
        if m.recipient:
            call = _call(m) if tools else None
            if call is None:
                return text, ()
            calls.append(call)
        elif m.channel != "analysis":
            said.append(message_text(m))
    content = "\n\n".join(s for s in said if s)
    if calls:
        return content.strip() or None, tuple(calls)
    return content, ()


def completion(*messages: Any) -> str:
    """Messages rendered by openai-harmony, as a completion: the prompt's `<|start|>assistant` and
    the stop token (`<|call|>` / `<|return|>`, stripped by the proxy) left off."""
    enc = encoding()
    text = str(enc.decode([t for m in messages for t in enc.render(m)]))
    text = text.removeprefix("<|start|>assistant")
    for stop in ("<|call|>", "<|return|>", "<|end|>"):
        text = text.removesuffix(stop)
    return text


# -- random completions ---------------------------------------------------------------------------

TEXTS = ("", "Let me look.", "héllo ✓ 日本語 🙂", "two\nlines\n", "  padded  ", "a < b | c > d", "to=x json")
ARGS = ('{"command": "ls -la"}', "{}", '{"a": [1, 2.5, null], "é": "✓"}', '{"command": "ls"', "[1]", "")


def rendered(rng: random.Random) -> str:
    """A completion of 1-4 messages rendered by openai-harmony: analysis, preambles, function calls
    (content type `<|constrain|>json`, bare `json` or none), finals; the recipient before the channel
    (harmony's order) or moved after it (the other order the template and models write)."""
    from openai_harmony import Message, Role

    msgs: list[Any] = []
    moves: list[tuple[str, str]] = []
    for _ in range(rng.randint(1, 4)):
        kind = rng.choice(("analysis", "analysis", "preamble", "call", "final"))
        if kind != "call":
            channel = "commentary" if kind == "preamble" else kind
            msgs.append(
                Message.from_role_and_content(Role.ASSISTANT, rng.choice(TEXTS)).with_channel(channel)
            )
            continue
        name = rng.choice(("bash", "bash", "read_file", "web.search"))
        recipient = f"functions.{name}" if rng.random() < 0.9 else f"browser.{name}"
        m = Message.from_role_and_content(Role.ASSISTANT, rng.choice(ARGS)).with_channel("commentary")
        m = m.with_recipient(recipient)
        ctype = rng.choice(("<|constrain|>json", "json", None))
        msgs.append(m.with_content_type(ctype) if ctype else m)
        if rng.random() < 0.5:
            moves.append((f" to={recipient}<|channel|>commentary", f"<|channel|>commentary to={recipient}"))
    text = completion(*msgs)
    for old, new in moves:
        text = text.replace(old, new, 1)
    return text


FRAGMENTS = (
    *("<|start|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>"),
    *("<|endoftext|>", "<|reserved_200012|>", "<|", "|>", "<", "assistant", "user", "tool", "functions.bash"),
    *("analysis", "commentary", "final", "to=functions.bash", "to=", "to=browser.search", "json", "x"),
    *(" ", " ", "\n", "\t", "\x0b", "\x0c", "\x1c", "\xa0", "\u3000", "\u200b", "é", "日本"),
    *('{"command": "ls"}', "{", "[1]"),
)


def hostile(rng: random.Random) -> str:
    """Up to 24 random framing fragments (special tokens, role and channel words, recipients, every
    kind of whitespace harmony tells apart, JSON, unicode), or a rendered completion with 1-3 of them
    put in, or a piece cut out, at random places."""
    if rng.random() < 0.5:
        return "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 24)))
    text = rendered(rng)
    for _ in range(rng.randint(1, 3)):
        i = rng.randint(0, len(text))
        if rng.random() < 0.25:
            text = text[:i] + text[i + rng.randint(1, 12) :]
        else:
            text = text[:i] + rng.choice(FRAGMENTS) + text[i:]
    return text


def calls_of(calls: Calls) -> list[tuple[str, Any]]:
    """Calls without their random ids."""
    return [(c.name, json.loads(c.arguments)) for c in calls]
