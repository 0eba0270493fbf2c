"""The framework harness: an episode whose agent loop belongs to an adapter.

Concept: `FrameworkHarness` (`--harness framework`) looks `task.metadata["adapter"]`
up in `ADAPTERS` and runs that environment class's `run_episode(task, sandbox, endpoint)`,
which asks its worker to run the framework's own agent loop against the TITO
session URL (or, for OpenEnv, runs our loop over the env's reset/step). The
framework's reward travels back in the transcript as one final message
`{"role": "framework", "reward": ..., ...}`, which the adapter environment's
`verify` reads (`framework_reward`).

Invariant: a worker crash, hang or garbage answer never raises out of `run`; it
is an episode with Status.FAILED and the error kept. By default each episode's
worker runs inside that episode's sandbox (`isolation.py`); with
`isolation="none"` workers are pooled on the host per (adapter, target) and per
event loop (worker_pool.py).
"""

from __future__ import annotations

from typing import Any

import anyio

from miles_env.adapters.isolation import isolation_of
from miles_env.adapters.worker_client import WorkerError
from miles_env.environment import Transcript
from miles_env.errors import MilesEnvError
from miles_env.harness import Endpoint, HarnessResult
from miles_env.sandbox import Sandbox
from miles_env.types import EpisodeEnd, Reward, Status, Task

__all__ = ["FrameworkHarness", "framework_reward", "FRAMEWORK_ROLE"]

FRAMEWORK_ROLE = "framework"


def framework_reward(task: Task, transcript: Transcript) -> Reward:
    """The reward the framework computed, from the transcript's final framework message."""
    for msg in reversed(list(transcript)):
        if msg.get("role") == FRAMEWORK_ROLE:
            return Reward(score=float(msg.get("reward") or 0.0), details=dict(msg.get("details") or {}))
    return Reward(score=0.0, details={"error": f"no framework result for task {task.id!r} (harness failed?)"})


class FrameworkHarness:
    name = "framework"
    verifies_in_run = True  # the framework scores inside run(): VerifiesInRun

    def __init__(self, **config: Any) -> None:
        # isolation: "sandbox" (default: a fresh worker inside the episode's sandbox) or
        # "none" (the pooled worker on the host); see adapters/isolation.py.
        config["isolation"] = isolation_of(config.get("isolation"))
        self.config = config

    async def run(self, task: Task, sandbox: Sandbox, endpoint: Endpoint) -> HarnessResult:
        adapter = task.metadata.get("adapter")
        if not isinstance(adapter, str):
            return HarnessResult(
                Status.FAILED, [], f"task {task.id!r} has no metadata.adapter: not an adapter task"
            )
        from miles_env.adapters import ADAPTERS

        try:
            run_episode = ADAPTERS.load(adapter).run_episode
            return await run_episode(task, sandbox, endpoint, **self.config)  # type: ignore[no-any-return]
        except (WorkerError, MilesEnvError) as e:  # its class where it has one (a worker's: adapter_worker)
            return HarnessResult(Status.FAILED, [], f"{type(e).__name__}: {e}", end=e.end)
        except (anyio.get_cancelled_exc_class(), KeyboardInterrupt):
            raise
        except Exception as e:  # a malformed answer (missing key, wrong type) is a failed episode too
            return HarnessResult(
                Status.FAILED, [], f"adapter {adapter!r}: unexpected {type(e).__name__}: {e}",
                end=EpisodeEnd.ADAPTER_WORKER,
            )  # fmt: skip
