"""The OpenAI Responses dialect (what Codex speaks), reply side: output items, the body, SSE events.

Concept: a core `ChatResult` becomes the Responses output items, in order: a `reasoning` item
when the parsers split reasoning off (summary = the reasoning text, `encrypted_content` = our
exact-text codec, wire.py), an assistant `message` (its id the turn's `msg_...` reply id) when
there is text or no tool call, then one `function_call` per call (with `namespace` when the tool
was a namespace member, as Codex dispatches it) or `custom_tool_call` for a freeform tool
(`ToolKinds`, from the request side: openai_responses.py). `response_body` wraps them with usage
and status (`incomplete` when the turn ran out of tokens); `stream_events` is the SSE sequence
Codex accepts, response.created to response.completed, text in `piece`-character deltas.

Invariant: ids derive from the reply id and the call ids (`rs_`, `fc_`, `ctc_` + the same
suffix), so the history Codex resends names the same items the proxy stored.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from miles_env.tito.messages import ChatResult
from miles_env.tito.openai_responses import ToolKinds
from miles_env.tito.parsers import reasoning_of
from miles_env.tito.wire import custom_input, encode_reasoning, sse

__all__ = ["output_items", "response_body", "stream_events"]


def output_items(result: ChatResult, reply_id: str, kinds: ToolKinds) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    think, rest = reasoning_of(result), result.content or ""
    suffix = reply_id.removeprefix("msg_")
    if think is not None:
        summary = [{"type": "summary_text", "text": think.text}]
        enc = encode_reasoning((think.lead, think.text, think.trail))
        items.append(
            {"type": "reasoning", "id": "rs_" + suffix, "summary": summary, "encrypted_content": enc}
        )
    if rest or not result.tool_calls:
        part: dict[str, Any] = {"type": "output_text", "text": rest, "annotations": [], "logprobs": []}
        items.append(
            {"type": "message", "id": reply_id, "status": "completed", "role": "assistant", "content": [part]}
        )
    for c in result.tool_calls:
        cs = c.id.removeprefix("call_")
        if c.name in kinds.custom:
            item = {"type": "custom_tool_call", "id": "ctc_" + cs, "call_id": c.id, "name": c.name}
            items.append({**item, "input": custom_input(c.arguments), "status": "completed"})
        else:
            item = {"type": "function_call", "id": "fc_" + cs, "call_id": c.id, "name": c.name}
            if c.name in kinds.namespace:
                item["namespace"] = kinds.namespace[c.name]
            items.append({**item, "arguments": c.arguments, "status": "completed"})
    return items


def response_body(
    result: ChatResult, reply_id: str, kinds: ToolKinds, model: str, done: bool = True
) -> dict[str, Any]:
    incomplete = result.finish_reason == "length"
    status = ("incomplete" if incomplete else "completed") if done else "in_progress"
    usage = {
        "input_tokens": result.prompt_tokens,
        "input_tokens_details": {"cached_tokens": result.cached_tokens},
        "output_tokens": result.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }
    return {
        "id": "resp_" + reply_id.removeprefix("msg_"),
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": model,
        "output": output_items(result, reply_id, kinds) if done else [],
        "usage": usage if done else None,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete and done else None,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }


def stream_events(
    result: ChatResult, reply_id: str, kinds: ToolKinds, model: str, piece: int = 32
) -> Iterator[str]:
    """The SSE sequence Codex accepts, from response.created to response.completed."""
    seq = iter(range(1 << 30))

    def ev(kind: str, **data: Any) -> str:
        return sse(kind, {"type": kind, "sequence_number": next(seq), **data})

    start = response_body(result, reply_id, kinds, model, done=False)
    yield ev("response.created", response=start)
    yield ev("response.in_progress", response=start)
    final = response_body(result, reply_id, kinds, model)
    for i, item in enumerate(final["output"]):
        yield from _item_events(ev, i, item, piece)
    yield ev(
        "response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final
    )


def _item_events(ev: Any, i: int, item: dict[str, Any], piece: int) -> Iterator[str]:
    kind, iid = item["type"], item["id"]
    if kind == "message":
        yield ev(
            "response.output_item.added",
            output_index=i,
            item={**item, "status": "in_progress", "content": []},
        )
        part = item["content"][0]
        text = part["text"]
        empty = {**part, "text": ""}
        yield ev("response.content_part.added", item_id=iid, output_index=i, content_index=0, part=empty)
        for k in range(0, len(text), piece):
            delta = text[k : k + piece]
            yield ev(
                "response.output_text.delta",
                item_id=iid,
                output_index=i,
                content_index=0,
                delta=delta,
                logprobs=[],
            )
        yield ev(
            "response.output_text.done", item_id=iid, output_index=i, content_index=0, text=text, logprobs=[]
        )
        yield ev("response.content_part.done", item_id=iid, output_index=i, content_index=0, part=part)
    elif kind == "function_call":
        yield ev(
            "response.output_item.added",
            output_index=i,
            item={**item, "status": "in_progress", "arguments": ""},
        )
        args = item["arguments"]
        yield ev("response.function_call_arguments.delta", item_id=iid, output_index=i, delta=args)
        yield ev("response.function_call_arguments.done", item_id=iid, output_index=i, arguments=args)
    elif kind == "custom_tool_call":
        yield ev(
            "response.output_item.added", output_index=i, item={**item, "status": "in_progress", "input": ""}
        )
        yield ev("response.custom_tool_call_input.delta", item_id=iid, output_index=i, delta=item["input"])
        yield ev("response.custom_tool_call_input.done", item_id=iid, output_index=i, input=item["input"])
    else:
        yield ev("response.output_item.added", output_index=i, item=item)
    yield ev("response.output_item.done", output_index=i, item=item)
