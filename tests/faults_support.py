"""An environment double for the fault-injected runs (a helpers module, not a test module).

`FlakyBasics` is terminal-basics (its tasks, sandboxes and setup) with two changes a run can see:
its verifier crashes on every `CRASH_EVERY`-th call (RuntimeError: the episode is VERIFIER_ERROR,
classed by the rollout's phase), and it grades by a coin the sample itself throws (the parity of
the model's last reply's length), so a tiny random model's GRPO groups carry both rewards and
train something. Loaded by reference: `env: tests.faults_support:FlakyBasics`.
"""

from __future__ import annotations

import itertools
from typing import Any

from miles_env_terminal_basics import TerminalBasics

from miles_env.environment import Transcript
from miles_env.sandbox import Sandbox
from miles_env.types import Reward, Task

__all__ = ["CRASH_EVERY", "FlakyBasics"]

CRASH_EVERY = 6


class FlakyBasics(TerminalBasics):
    name = "terminal-basics"  # its tasks name it: the same tasks, a flakier verifier

    def __init__(self) -> None:
        super().__init__()
        self._calls = itertools.count(1)

    async def verify(self, task: Task, sandbox: Sandbox, transcript: Transcript) -> Reward:
        n = next(self._calls)
        if n % CRASH_EVERY == 0:
            raise RuntimeError(f"injected fault: verifier crash on call {n}")
        replies = [m for m in transcript if isinstance(m, dict) and m.get("role") == "assistant"]
        text: Any = replies[-1].get("content", "") if replies else ""
        return Reward(score=float(len(str(text)) % 2), details={"coin": len(str(text))})
