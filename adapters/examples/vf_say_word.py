"""A small verifiers.v1 taskset (written for miles-env's adapter tests): say the word.

Reward (the taskset's own `@vf.reward`): 1.0 when the agent's reply contains the word.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.task import Task, TaskData
from verifiers.v1.taskset import Taskset

WORDS = ["apple", "river", "stone", "cloud"]


class SayData(TaskData):
    word: str = ""


class SayTask(Task[SayData]):
    @vf.reward
    async def said_it(self, trace: Any) -> float:
        return 1.0 if self.data.word in trace.last_reply.lower() else 0.0


class SayWordTaskset(Taskset[SayTask]):
    def load(self) -> Iterator[SayTask]:
        for w in WORDS:
            yield SayTask(SayData(id=f"say-{w}", prompt=f"Say the word '{w}'.", word=w), self.config.task)


__all__ = ["SayWordTaskset"]
