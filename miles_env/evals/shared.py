"""`eval.mode: shared`: eval episodes on the rollout stack's engine, in line (the default).

The eval split runs through the same engine, proxy and sandboxes as the training rollouts, at
the weights they serve at that moment (the trainer's step: the job syncs after every step).
In line, so the trainer waits for it; in fully_async mode the producers keep sharing the
engine with it. Rows: `eval` under the step, as `run_eval_episodes` writes them.
"""

from __future__ import annotations

from functools import partial

from miles_env.evals.base import Evaluator, run_eval_episodes

__all__ = ["SharedEval"]


class SharedEval(Evaluator):
    async def evaluate(self, step: int) -> None:
        await self.record(step, partial(run_eval_episodes, self.setup, self.setup.context, step))
