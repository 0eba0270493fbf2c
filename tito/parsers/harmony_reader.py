"""A reader of gpt-oss's harmony completion framing: messages out of the decoded text, in linear time.

Concept: a gpt-oss completion (the prompt ended on `<|start|>assistant`, the proxy stripped the stop
token) is one or more messages, `HEADER<|message|>TEXT`, each ended by `<|end|>`, `<|call|>` or
`<|return|>` and the next opened by `<|start|>`. A header is `[ROLE][ to=RECIPIENT]<|channel|>CHANNEL
[ to=RECIPIENT][ CONTENT_TYPE]`, the content type bare (` json`) or constrained (` <|constrain|>json`);
the first message's role is the prompt's (`assistant`), later ones name theirs. This module reads
exactly what openai-harmony 0.0.8 reads (`parse_messages_from_completion_tokens` with the assistant
role, strict), rule for rule, on the text instead of on o200k ids: its `StreamableParser` and
`parse_header_from_string` are a state machine over special tokens plus a whitespace split of the
header, so the same rules over `str.find` give the same messages (tests/test_tito_gpt_oss.py checks
it against openai-harmony on rendered and on hostile completions). Special tokens never overlap
(`<|...|>`, no `<|` inside), so the text's first `<|message|>` is the ids' first `<|message|>` token.

Invariant: `read` never raises and is linear in the text (a policy optimised for reward writes it):
each special token is searched forward from where the last search for it ended (`_Next`), so no
byte is scanned twice for the same token; the header's channel name is cut with one negated
character class (no backtracking). Text the framing cannot read gives None, as harmony's error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Frame", "read", "START", "MESSAGE", "END"]

START = "<|start|>"
MESSAGE = "<|message|>"
END = "<|end|>"
_CHANNEL = "<|channel|>"
_CONSTRAIN = "<|constrain|>"
_STOPS = (END, "<|call|>", "<|return|>")  # harmony's stop tokens: each ends a message's text
_ROLES = frozenset({"user", "assistant", "system", "developer", "tool"})
_FIRST_ROLE = "assistant"
# Rust's char::is_whitespace (Unicode White_Space; Python's str.isspace also takes \x1c-\x1f) and
# u8::is_ascii_whitespace (no \x0b), the two whitespace notions harmony's header parser uses.
_WS = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
_ASCII_WS = str.maketrans("\t\n\x0c\r", "    ")
_CHANNEL_NAME = re.compile(f"[^{re.escape(_WS)}<]*")  # up to the first whitespace or '<'


@dataclass(frozen=True, slots=True)
class Frame:
    """One message: where its header begins (after its `<|start|>`; 0 for the first), its channel,
    its recipient (as harmony gives it: `functions.bash`, or "" for a bare `to=`) and its text."""

    begin: int
    channel: str | None
    recipient: str | None
    text: str


class _Next:
    """The next occurrence of a token at or after a position (len(text) if none); positions asked
    only grow, so each token's searches together scan the text once."""

    __slots__ = ("_text", "_at")

    def __init__(self, text: str) -> None:
        self._text = text
        self._at: dict[str, int] = {}

    def __call__(self, token: str, pos: int) -> int:
        at = self._at.get(token, -1)
        if at < pos:
            found = self._text.find(token, pos)
            at = len(self._text) if found < 0 else found
            self._at[token] = at
        return at


def read(text: str) -> list[Frame] | None:
    """The completion's messages, or None where openai-harmony's parser would fail."""
    nxt = _Next(text)
    frames: list[Frame] = []
    pos, first, size = 0, True, len(text)
    while True:
        body = nxt(MESSAGE, pos)
        if body == size:
            return None  # the text ends inside a header
        header = _header(text[pos:body], first)
        if header is None:
            return None
        body += len(MESSAGE)
        end, stop = min((nxt(s, body), s) for s in _STOPS)
        frames.append(Frame(pos, header[0], header[1], text[body:end]))
        after = end + len(stop)
        if end == size or after == size:
            return frames
        if not text.startswith(START, after):
            return None  # after a stop token only `<|start|>` may follow
        pos, first = after + len(START), False


def _header(header: str, first: bool) -> tuple[str | None, str | None] | None:
    """(channel, recipient) of a header, or None where harmony rejects it."""
    channel = None
    i = header.find(_CHANNEL)
    if i >= 0:
        start = i + len(_CHANNEL)
        name = _CHANNEL_NAME.match(header, start)
        channel = name.group() if name else ""
        if not channel:
            return None
        header = header[:i] + header[start + len(channel) :]
    header = header.strip(_WS)
    if _CONSTRAIN in header:
        header = header.replace(_CONSTRAIN, " " + _CONSTRAIN).strip(_WS)
    parts = [p for p in header.translate(_ASCII_WS).split(" ") if p]
    role = _role(parts, first)
    if role is None:
        return None
    if parts and parts[0] == role:
        parts.pop(0)
    recipient = _recipient(parts)
    return None if parts else (channel, recipient)


def _role(parts: list[str], first: bool) -> str | None:
    """The header's role: given for the first message, else its first word (an unknown word before
    more words, or a `to=` word alone, is a tool's name and is dropped); None if there is none."""
    if first:
        return _FIRST_ROLE
    if not parts:
        return None
    if parts[0] in _ROLES:
        return parts[0]
    if len(parts) > 1 or parts[0].startswith("to="):
        parts.pop(0)
        return "tool"
    return None


def _recipient(parts: list[str]) -> str | None:
    """Takes the recipient and content type off the end of `parts`: `to=R`, a lone word (a recipient),
    or `[to=]R TYPE`; what is left over is not a header."""
    if not parts:
        return None
    alone = len(parts) == 1
    last = parts.pop()
    if last.startswith("to="):
        return last[3:]
    if alone:
        return last
    raw = parts.pop()  # `last` was the content type
    return raw[3:] if raw.startswith("to=") else raw
