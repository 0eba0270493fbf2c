"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the whole reply is `{"name": ..., "parameters": {...}}`.

Format (meta-llama Llama-3.1/3.2/3.3 chat templates, "JSON based tool calling" in the
model card; vLLM's `llama3_json`): the reply is one JSON object, or several separated
by `;`, optionally after `<|python_tag|>` (which the model also uses for its built-in
tools). `arguments` is accepted for `parameters`. Anything else (prose around the JSON,
an object without a string `name`) is plain content.
"""

from __future__ import annotations

import json

from miles_env.tito import strictjson
from miles_env.tito.messages import ToolCall
from miles_env.tito.parsers.base import Calls, Tools, json_call

__all__ = ["parse"]

_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def _objects(body: str) -> list[ToolCall] | None:
    calls: list[ToolCall] = []
    pos = 0
    while True:
        while pos < len(body) and (body[pos].isspace() or (calls and body[pos] == ";")):
            pos += 1
        if pos >= len(body):
            return calls or None
        try:
            end = _DECODER.raw_decode(body, pos)[1]
            obj = strictjson.loads(body[pos:end])  # strict: no NaN, bounded depth
        except (ValueError, RecursionError, strictjson.JSONError):
            return None
        if not isinstance(obj, dict):
            return None
        call = json_call(obj.get("name"), obj.get("parameters", obj.get("arguments", {})))
        if call is None:
            return None
        calls.append(call)
        pos = end


def parse(text: str, tools: Tools = ()) -> tuple[str | None, Calls]:
    head, tag, body = text.partition(_TAG)
    if not tag:
        head, body = "", text
    if not body.lstrip().startswith("{"):
        return text, ()
    calls = _objects(body)
    if calls is None:
        return text, ()
    return (head.strip() or None), tuple(calls)
