"""Render normalized messages to text and ids with the model's chat template.

Concept: a full render is `apply_chat_template(messages, tools)`; a *suffix*
render costs only the tail: render(anchor + tail) minus render(anchor), where the
anchor is a fixed three-message conversation (system, user, assistant). The diff
is used when render(anchor) is a true string prefix of render(anchor + tail). A
template that renders the anchor reply differently once a message follows it
(Qwen3 drops the reply's empty `<think>` block) is cut after the reply and its
closing instead, provided the system and user messages render unchanged (nothing
of the tail was placed before the reply); otherwise `render_suffix` returns None
and the caller re-renders everything on a new branch. After a stored assistant
turn the template's closing text (for chatml `<|im_end|>\n`) and the suffix follow;
when the sampled ids already end with a stop token that text starts with, only the
rest is new (`\n` for chatml; GLM samples `<|observation|>`, which opens the tool
message that follows). A tail that opens with tool results follows an anchor reply that carries
the stored turn's calls (by name: gpt-oss names the tool result after the call it answers, and
refuses one without a call); the closing of a stored turn that sampled a stop token is then cut
at the template's own copy of it. A template may close its last reply with one special token
and a followed one with another (gpt-oss: `<|return|>`, `<|end|>`): the sampled one stays.

Tools: templates that mention `tools` get them natively. Others (plain chatml,
e.g. SmolLM2) get the text-action fallback: the schemas go into the system prompt
with an instruction to answer with `<tool_call>{json}</tool_call>` blocks;
assistant tool calls render as those blocks; a tool result becomes a *user*
message wrapping the result in `<tool_response>...</tool_response>` (hermes style,
which is what Qwen-family templates produce too).
"""

from __future__ import annotations

import json
from typing import Any

from miles_env.tito.bound import min_tokens, size_bound
from miles_env.tito.messages import Message, ToolCall

__all__ = ["Renderer", "TemplateRefused"]

_RELEASE_GIL_CHARS = 4096
_MAX_ANCHORS = 256
_ANCHOR_TEXT = "zqxanchorzqx"
_ANCHOR = (
    Message("system", _ANCHOR_TEXT),
    Message("user", _ANCHOR_TEXT),
    Message("assistant", _ANCHOR_TEXT),
)
_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


class TemplateRefused(ValueError):
    """The chat template raised on these messages (e.g. its own role-order check): a client mistake."""


def tools_prompt(tools: tuple[dict[str, Any], ...]) -> str:
    return _TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def _texts(m: Message) -> str:
    return "\n".join((m.content, m.name or "", *(c.name + c.arguments for c in m.tool_calls)))


class Renderer:
    """Template rendering and tokenization for one tokenizer (thread-safe, stateless but for caches)."""

    def __init__(self, tokenizer: Any, *, tool_mode: str = "auto", stop_token: str | None = None) -> None:
        self.tok = tokenizer
        self._fast = getattr(tokenizer, "_tokenizer", None)  # the `tokenizers` backend: faster encode
        template = tokenizer.chat_template or ""
        self.native_tools = tool_mode == "template" or (tool_mode == "auto" and "tools" in template)
        stop_id = tokenizer.convert_tokens_to_ids(stop_token) if stop_token else None
        if not isinstance(stop_id, int) or stop_id < 0 or stop_id == getattr(tokenizer, "unk_token_id", None):
            stop_id = tokenizer.eos_token_id
        self.stop_id: int = int(stop_id)
        # (tools key, names of the calls the anchor reply makes) -> (render(anchor), assistant close)
        self._anchor: dict[tuple[str, tuple[str, ...]], tuple[str, str]] = {}
        self._specials = sorted(getattr(tokenizer, "get_added_vocab", dict)(), key=len, reverse=True)
        self.size_bound = size_bound(self._fast)  # None: no proof, prompts are tokenized in full (bound.py)

    # -- text ------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        if self._fast is not None:
            if len(text) >= _RELEASE_GIL_CHARS:  # encode_batch runs without the GIL: the loop keeps serving
                return list(self._fast.encode_batch([text], add_special_tokens=False)[0].ids)
            return list(self._fast.encode(text, add_special_tokens=False).ids)
        return list(self.tok.encode(text, add_special_tokens=False))

    def min_tokens(self, text: str) -> int:
        """A proven lower bound on `len(encode(text))`, from its size alone (0 when unprovable)."""
        return min_tokens(text, self.size_bound)

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=False))

    # -- messages -> template dicts ----------------------------------------------------------------
    def _assistant(self, m: Message) -> dict[str, Any]:
        d: dict[str, Any] = {"role": "assistant", "content": m.content}
        if m.reasoning is not None:  # the vLLM / SGLang field reasoning templates read
            d["reasoning_content"] = m.reasoning
        if self.native_tools and m.tool_calls:
            d["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_obj()}}
                for c in m.tool_calls
            ]
        elif m.tool_calls:
            blocks = (
                "<tool_call>\n"
                + json.dumps({"name": c.name, "arguments": c.arguments_obj()}, ensure_ascii=False)
                + "\n</tool_call>"
                for c in m.tool_calls
            )
            d["content"] = "\n".join([m.content, *blocks]).strip()
        return d

    def _dicts(self, messages: tuple[Message, ...] | list[Message]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for m in messages:
            if m.role == "assistant":
                out.append(self._assistant(m))
            elif m.role == "tool":
                if self.native_tools:
                    d: dict[str, Any] = {"role": "tool", "content": m.content}
                    if m.tool_call_id:
                        d["tool_call_id"] = m.tool_call_id
                    if m.name:
                        d["name"] = m.name
                    out.append(d)
                else:
                    out.append({"role": "user", "content": f"<tool_response>\n{m.content}\n</tool_response>"})
            else:
                out.append({"role": m.role, "content": m.content})
        return out

    def _apply(self, dicts: list[dict[str, Any]], tools: tuple[dict[str, Any], ...], gen: bool) -> str:
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": gen}
        if tools and self.native_tools:
            kwargs["tools"] = list(tools)
        try:
            return str(self.tok.apply_chat_template(dicts, **kwargs))
        except Exception as e:  # jinja2 is transformers' dependency, not ours: matched by module
            if type(e).__module__.startswith("jinja2"):
                raise TemplateRefused(str(e)) from None
            raise

    # -- rendering ----------------------------------------------------------------------------------
    def render_full(self, messages: tuple[Message, ...], tools: tuple[dict[str, Any], ...]) -> str:
        dicts = self._dicts(messages)
        if tools and not self.native_tools:
            text = tools_prompt(tools)
            if dicts and dicts[0]["role"] == "system":
                dicts[0] = {"role": "system", "content": dicts[0]["content"] + "\n\n" + text}
            else:
                dicts.insert(0, {"role": "system", "content": text})
        return self._apply(dicts, tools, gen=True)

    def _anchor_parts(
        self, tools: tuple[dict[str, Any], ...], tkey: str, calls: tuple[str, ...] = ()
    ) -> tuple[str, str]:
        cached = self._anchor.get((tkey, calls))
        if cached is None:
            if len(self._anchor) >= _MAX_ANCHORS:  # call names are the model's: keep the cache bounded
                self._anchor.clear()
            base = self._apply(self._dicts(_anchor(calls)), tools, gen=False)
            close = base[base.rindex(_ANCHOR_TEXT) + len(_ANCHOR_TEXT) :]
            cached = self._anchor[(tkey, calls)] = (base, close)
        return cached

    def after_turn(
        self,
        suffix: str,
        tools: tuple[dict[str, Any], ...],
        tkey: str,
        stop: str | None,
        tail: tuple[Message, ...] = (),
        after: tuple[ToolCall, ...] = (),
    ) -> str:
        """Template text that follows a stored assistant turn's sampled ids: its closing, then `suffix`.

        `stop` is the text of the stop token the turn sampled (None when it ended otherwise): the ids
        already hold it, so it is dropped from the front (chatml: `<|im_end|>` of the closing; GLM: the
        `<|user|>` / `<|observation|>` that also opens the next message). `tail` and `after` (the
        turn's calls) as given to `render_suffix`: an anchor reply with calls closes where the
        template writes `stop` after the reply's text, if it does."""
        close = self._anchor_parts(tools, tkey)[1]
        names = _call_names(tail, after)
        if names and stop:
            base = self._anchor_parts(tools, tkey, names)[0]
            at = base.find(stop, base.rindex(_ANCHOR_TEXT))
            close = base[at:] if at >= 0 else close
        text = close + suffix
        if stop and text.startswith(stop):
            return text[len(stop) :]
        return text

    def render_suffix(
        self,
        tail: tuple[Message, ...],
        tools: tuple[dict[str, Any], ...],
        tkey: str,
        after: tuple[ToolCall, ...] = (),
    ) -> str | None:
        """Text the template adds for `tail` (and the generation prompt) after an assistant turn that
        made the calls `after`."""
        names = _call_names(tail, after)
        base, close = self._anchor_parts(tools, tkey, names)
        full = self._apply(self._dicts(_anchor(names) + tail), tools, gen=True)
        if full.startswith(base):
            return full[len(base) :]
        # The template renders the anchor reply differently once a message follows it (Qwen3 drops
        # its empty <think> block): cut after the reply and its closing instead; what the template
        # prints before the reply is replaced by the stored ids anyway. Sound only when the system and
        # user messages render as in `base`, so no part of the tail was placed before the reply (a
        # template that hoists a later system message to the top), and the reply is found by its text
        # (no tail message contains the anchor text): else None, a full render.
        reply = base.rindex(_ANCHOR_TEXT)
        head = base[: base.rindex(_ANCHOR_TEXT, 0, reply) + len(_ANCHOR_TEXT)]  # through the user's text
        if not full.startswith(head) or any(_ANCHOR_TEXT in _texts(m) for m in tail):
            return None
        end = full.find(_ANCHOR_TEXT, len(head)) + len(_ANCHOR_TEXT)
        closing = self._closing(full, end, close) if end >= len(_ANCHOR_TEXT) else None
        return None if closing is None else full[end + len(closing) :]

    def _closing(self, full: str, at: int, close: str) -> str | None:
        """The reply's closing in `full` at `at`: `close`, or another special token where `close` is one
        (gpt-oss closes its last reply with <|return|>, a reply that a message follows with <|end|>)."""
        if full.startswith(close, at):
            return close
        if close in self._specials:
            return next((t for t in self._specials if full.startswith(t, at)), None)
        return None


def _call_names(tail: tuple[Message, ...], after: tuple[ToolCall, ...]) -> tuple[str, ...]:
    """The calls the anchor reply makes: `after`'s, by name, when the tail opens with a tool result."""
    return tuple(c.name for c in after) if tail and tail[0].role == "tool" else ()


def _anchor(calls: tuple[str, ...]) -> tuple[Message, ...]:
    if not calls:
        return _ANCHOR
    made = tuple(ToolCall(f"call_anchor_{i}", name, "{}") for i, name in enumerate(calls))
    return (*_ANCHOR[:2], Message("assistant", _ANCHOR_TEXT, made))
