"""gpt-oss (harmony) completions, parsed by openai-harmony: channels, function calls, the answer.

Format (openai/harmony, the gpt-oss chat template): the prompt ends with `<|start|>assistant`;
the completion is one or more messages, each `<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]
<|message|>TEXT`, joined by `<|end|><|start|>assistant` (the recipient may also stand before the
channel: `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>`). The engine
stops on `<|call|>` after a function call and `<|return|>` after the final answer; the proxy
strips that stop token before parsing. Channels: `analysis` (reasoning), `commentary` (function
calls to `functions.NAME`, and preambles), `final` (the answer).

The text is encoded with harmony's own o200k_harmony encoding (special tokens allowed) and read
by `parse_messages_from_completion_tokens`, so no harmony grammar is written here; the vocabulary
comes from a PyPI package, offline (harmony_vocab.py). `reasoning` splits the leading analysis
messages off exactly (`lead + text + trail + rest` is the input; several leading analysis messages
are one reasoning whose text keeps the framing between them); `parse` turns the rest into
content (final and preamble texts, framing dropped) and calls (`functions.NAME`, JSON arguments).
Text harmony cannot parse, a call to another recipient or a call with bad JSON leaves the whole
text as content: a bad completion is data, never an error. Without tools, calls stay text.

Cost: harmony's parser costs ~10 us a token plus ~60 us a call (bench/bench_parsers.py), so a turn
parses once: `reasoning` hands the messages after its split to the `parse` of that exact rest that
follows it in the same thread (`_handoff`, one slot, taken once); any other text is parsed anew.
"""

from __future__ import annotations

import threading
from functools import cache
from typing import Any

from miles_env.tito.messages import ToolCall
from miles_env.tito.parsers.base import Calls, Reasoning, Tools, json_call
from miles_env.tito.parsers.harmony_vocab import ensure_vocab

__all__ = ["parse", "reasoning", "harmony_messages"]

_START = "<|start|>"
_ROLE = "assistant"
_MESSAGE = "<|message|>"
_END = "<|end|>"
_FUNCTIONS = "functions."
_CHANNEL = "<|channel|>"
_handoff = threading.local()  # .rest, .msgs: the messages of the text `reasoning` left, for `parse`


@cache
def _encoding() -> Any:
    """openai-harmony's gpt-oss encoding, loaded once from the offline vocabulary."""
    ensure_vocab()
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def harmony_messages(text: str) -> list[Any] | None:
    """The completion's harmony messages (openai_harmony.Message), or None if harmony cannot parse it."""
    from openai_harmony import Role

    enc = _encoding()
    try:
        # every special token allowed, so none is disallowed: () skips the wrapper's set difference
        ids = enc.encode(text, allowed_special="all", disallowed_special=())
        return list(enc.parse_messages_from_completion_tokens(ids, Role.ASSISTANT))
    except Exception:  # HarmonyError (not exported by every version): not harmony, so plain text
        return None


def _text(message: Any) -> str:
    return "".join(getattr(c, "text", "") for c in message.content)


def _nth_start(text: str, n: int) -> int:
    """Where message `n` (0-based, n >= 1) of the completion begins: after its `<|start|>assistant`."""
    pos = -1
    for _ in range(n):
        pos = text.index(_START, pos + 1)
    end = pos + len(_START)
    return end + len(_ROLE) if text.startswith(_ROLE, end) else end


def reasoning(text: str) -> tuple[Reasoning | None, str]:
    """The leading analysis messages as one exact Reasoning, and the text after them."""
    msgs = harmony_messages(text)
    if not msgs or msgs[0].channel != "analysis":
        return None, text
    n = next((i for i, m in enumerate(msgs) if m.channel != "analysis"), len(msgs))
    split = len(text) if n == len(msgs) else _nth_start(text, n)
    region, rest = text[:split], text[split:]
    if rest.startswith(_CHANNEL):  # a message header, role given: the rest parses to the same messages
        _handoff.rest, _handoff.msgs = rest, msgs[n:]
    a = region.index(_MESSAGE) + len(_MESSAGE)
    b = region.rfind(_END)
    b = b if b >= a else len(region)
    return Reasoning(region[:a], region[a:b], region[b:]), rest


def _call(message: Any) -> ToolCall | None:
    recipient = message.recipient or ""
    if not recipient.startswith(_FUNCTIONS):
        return None
    return json_call(recipient[len(_FUNCTIONS) :], _text(message))


def parse(text: str, tools: Tools = ()) -> tuple[str | None, Calls]:
    """Content (final and preamble texts) and function calls; the whole text when harmony cannot read it."""
    rest, msgs = getattr(_handoff, "rest", None), getattr(_handoff, "msgs", None)
    _handoff.rest = _handoff.msgs = None
    if rest != text or msgs is None:
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
            said.append(_text(m))
    content = "\n\n".join(s for s in said if s)
    if calls:
        return content.strip() or None, tuple(calls)
    return content, ()
