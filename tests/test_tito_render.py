"""Suffix rendering: when a template renders the anchor reply differently once a message follows it,
the suffix is cut after the reply, but only where that cut is sound; a template that places part of
the tail before the reply gets None (a full render on a new branch), never a suffix missing it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from miles_env.engines.scripted import ScriptedEngine
from miles_env.models import load_tokenizer
from miles_env.tito import ChatRequest, Message, TitoProxy
from miles_env.tito.messages import ToolCall, message_key
from miles_env.tito.render import _ANCHOR, _ANCHOR_TEXT, Renderer
from tests.tito_families import FAMILIES
from tests.tito_support import TOOLS, check_fidelity

pytestmark = pytest.mark.anyio

# chatml, but every system message is printed first (some templates merge them into one header),
# and an assistant reply that is not the last message loses a header mark, so render(anchor) is no
# prefix of render(anchor + tail): cutting after the reply would drop a later system message.
HOISTING = (
    "{%- for m in messages if m.role == 'system' %}<|im_start|>system\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- for m in messages if m.role != 'system' %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and loop.last %}*{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# the same without the hoisting: only the reply's header changes, the cut is sound
DROPPING = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and loop.last %}*{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def tokenizer(template: str) -> Any:
    tok = load_tokenizer()
    tok.chat_template = template
    return tok


def test_a_reply_rendered_differently_is_cut_after_its_closing() -> None:
    r = Renderer(tokenizer(DROPPING))
    tail = (Message("system", "Be brief."), Message("user", "hi"))
    assert not r._apply(r._dicts(_ANCHOR + tail), (), gen=True).startswith(r._anchor_parts((), "")[0])
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert r.render_suffix(tail, (), "") == expected


def test_a_template_that_places_the_tail_before_the_reply_gets_no_suffix() -> None:
    r = Renderer(tokenizer(HOISTING))
    tail = (Message("system", "Be brief."), Message("user", "hi"))
    full = r._apply(r._dicts(_ANCHOR + tail), (), gen=True)
    cut = full[full.rindex(_ANCHOR_TEXT) + len(_ANCHOR_TEXT) + len("<|im_end|>\n") :]
    assert "Be brief." not in cut  # what cutting after the reply alone would have returned
    assert r.render_suffix(tail, (), "") is None
    assert (
        r.render_suffix((Message("user", "hi"),), (), "")
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_tail_holding_the_anchor_text_gets_no_cut_suffix() -> None:
    r = Renderer(tokenizer(DROPPING))
    assert r.render_suffix((Message("user", f"say {_ANCHOR_TEXT}"),), (), "") is None


async def test_a_hoisted_system_message_starts_a_full_branch() -> None:
    tok = tokenizer(HOISTING)
    engine = ScriptedEngine(tok, ["one", "two", "three"])
    p = TitoProxy(engine, tok)
    sid = p.create_session().session_id
    u1, a1 = Message("user", "first"), Message("assistant", "one")
    await p.chat(sid, ChatRequest(messages=(u1,)))
    await p.chat(sid, ChatRequest(messages=(u1, a1, Message("user", "second"))))  # stitched
    late = (u1, a1, Message("user", "second"), Message("assistant", "two"), Message("system", "Be brief."))
    await p.chat(sid, ChatRequest(messages=(*late, Message("user", "third"))))
    trajs = p.export(sid)
    assert [len(t.turns) for t in trajs] == [2, 1]
    assert "Be brief." in tok.decode(list(engine.calls[2].input_ids))
    check_fidelity(trajs, engine, sid)


def test_a_full_render_hands_reasoning_to_the_template_and_identity_ignores_it() -> None:
    r = Renderer(next(f for f in FAMILIES if f.name == "qwen3").tokenizer())
    call = ToolCall("call_1", "bash", '{"command": "ls"}')
    thought = Message("assistant", "", (call,), reasoning="\nI should list the files.\n")
    history = (Message("user", "list files"), thought, Message("tool", "a.txt", tool_call_id="call_1"))
    with_it = r.render_full(history, tuple(TOOLS))
    assert "<|im_start|>assistant\n<think>\nI should list the files.\n</think>\n\n<tool_call>" in with_it
    without = r.render_full((history[0], replace(thought, reasoning=None), history[2]), tuple(TOOLS))
    assert "<think>" not in without and "<|im_start|>assistant\n<tool_call>" in without
    assert message_key(thought) == message_key(replace(thought, reasoning=None))
