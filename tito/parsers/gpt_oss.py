"""gpt-oss (harmony) completions: channels, function calls and the answer, read from the framing.

Format (openai/harmony, the gpt-oss chat template): the prompt ends with `<|start|>assistant`;
the completion is one or more messages, each `<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]
<|message|>TEXT`, joined by `<|end|><|start|>assistant` (the recipient may also stand before the
channel: `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>`). The engine
stops on `<|call|>` after a function call and `<|return|>` after the final answer; the proxy
strips that stop token before parsing. Channels: `analysis` (reasoning), `commentary` (function
calls to `functions.NAME`, and preambles), `final` (the answer).

The framing is read by harmony_reader.py, which follows openai-harmony's parser rule for rule on
the decoded text (openai-harmony itself is the oracle in tests/test_tito_gpt_oss.py; it cost
~0.5 ms a turn, mostly fixed, bench/results/parsers.md). `reasoning` splits the leading analysis
messages off exactly (`lead + text + trail + rest` is the input; several leading analysis messages
are one reasoning whose text keeps the framing between them); `parse` turns the rest into content
(final and preamble texts, framing dropped) and calls (`functions.NAME`, JSON arguments). Text the
framing cannot read, a call to another recipient or a call with bad JSON leaves the whole text as
content: a bad completion is data, never an error. Without tools, calls stay text.
"""

from __future__ import annotations

from miles_env.tito.messages import ToolCall
from miles_env.tito.parsers.base import Calls, Reasoning, Tools, json_call
from miles_env.tito.parsers.harmony_reader import END, MESSAGE, Frame, read

__all__ = ["parse", "reasoning"]

_ROLE = "assistant"
_FUNCTIONS = "functions."


def reasoning(text: str) -> tuple[Reasoning | None, str]:
    """The leading analysis messages as one exact Reasoning, and the text after them (from the next
    message's header, its `<|start|>assistant` left in the reasoning's trail)."""
    frames = read(text)
    if not frames or frames[0].channel != "analysis":
        return None, text
    n = next((i for i, f in enumerate(frames) if f.channel != "analysis"), len(frames))
    split = len(text)
    if n < len(frames):
        begin = frames[n].begin
        split = begin + len(_ROLE) if text.startswith(_ROLE, begin) else begin
    region, rest = text[:split], text[split:]
    a = region.index(MESSAGE) + len(MESSAGE)
    b = region.rfind(END)
    b = b if b >= a else len(region)
    return Reasoning(region[:a], region[a:b], region[b:]), rest


def _call(frame: Frame) -> ToolCall | None:
    recipient = frame.recipient or ""
    if not recipient.startswith(_FUNCTIONS):
        return None
    return json_call(recipient[len(_FUNCTIONS) :], frame.text)


def parse(text: str, tools: Tools = ()) -> tuple[str | None, Calls]:
    """Content (final and preamble texts) and function calls; the whole text when the framing cannot be read."""
    frames = read(text)
    if frames is None:
        return text, ()
    calls: list[ToolCall] = []
    said: list[str] = []
    for f in frames:
        if f.recipient:
            call = _call(f) if tools else None
            if call is None:
                return text, ()
            calls.append(call)
        elif f.channel != "analysis":
            said.append(f.text)
    content = "\n\n".join(s for s in said if s)
    if calls:
        return content.strip() or None, tuple(calls)
    return content, ()
