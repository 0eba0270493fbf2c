"""A small HUD environment (written for miles-env's adapter tests): say the word.

One `@env.template` (HUD's async-generator form: `answer = yield prompt; yield reward`)
and a taskset of four rows. Reward 1.0 when the agent's answer contains the word.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from hud import Environment
from hud.eval import Taskset

env = Environment("say-word")


@env.template()
async def say(word: str) -> AsyncIterator[object]:
    answer = yield f"Say the word '{word}'. Answer with the word only."
    yield 1.0 if word in str(answer).lower() else 0.0


tasks = Taskset("say-word", [say(word=w) for w in ("apple", "river", "stone", "cloud")])
