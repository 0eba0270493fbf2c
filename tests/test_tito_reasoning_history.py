"""Reasoning a client sends back reaches Message.reasoning in all three dialects (for full renders).

It is never part of a message's identity nor of a stitched prompt (the stored ids hold what was
sampled); a template that prints recent reasoning gets it when a request needs a full render.
"""

from __future__ import annotations

from miles_env.tito.anthropic_messages import MessagesRequest
from miles_env.tito.anthropic_messages import to_core as messages_core
from miles_env.tito.messages import message_key
from miles_env.tito.openai_chat import ChatCompletionRequest
from miles_env.tito.openai_chat import to_core as chat_core
from miles_env.tito.openai_responses import ResponsesRequest
from miles_env.tito.openai_responses import to_core as responses_core

THOUGHT = "I should list the files first."


def _assistant(messages):
    (reply,) = [m for m in messages if m.role == "assistant"]
    return reply


def test_chat_reasoning_content_is_kept_for_the_template():
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "ls", "reasoning_content": THOUGHT},
                {"role": "user", "content": "again"},
            ]
        }
    )
    reply = _assistant(chat_core(req).messages)
    assert reply.reasoning == THOUGHT and reply.content == "ls"
    bare = _assistant(
        chat_core(
            req.model_copy(
                update={
                    "messages": [
                        req.messages[0],
                        req.messages[1].model_copy(update={"reasoning_content": None}),
                        req.messages[2],
                    ]
                }
            )
        ).messages
    )
    assert bare.reasoning is None and message_key(bare) == message_key(reply)


def test_anthropic_thinking_blocks_are_kept_for_the_template():
    req = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 16,
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": THOUGHT, "signature": "x"},
                        {"type": "text", "text": "ls"},
                    ],
                },
                {"role": "user", "content": "again"},
            ],
        }
    )
    reply = _assistant(messages_core(req).messages)
    assert reply.reasoning == THOUGHT and reply.content == "ls"


def test_responses_reasoning_item_is_kept_for_the_template():
    req = ResponsesRequest.model_validate(
        {
            "input": [
                {"type": "message", "role": "user", "content": "hi"},
                {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": THOUGHT}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ls"}]},
                {"type": "message", "role": "user", "content": "again"},
            ]
        }
    )
    core, _ = responses_core(req)
    reply = _assistant(core.messages)
    assert reply.reasoning == THOUGHT and reply.content == "ls"
