"""Evaluation during training: three modes behind one small interface the job calls at eval points.

`eval.mode` names the evaluator, looked up in EVAL_MODES (the project's one plug-in idiom):
- `shared` (shared.py): eval episodes on the rollout stack's engine, in line, as always;
- `dedicated` (dedicated.py): eval episodes on an engine (and proxy) of its own, given the
  trainer's weights only at eval points; in fully_async mode they run in their own task;
- `external` (external.py): each eval point exports the weights and hands the checkpoint to a
  user command or URL, in its own task; what it answers is logged as `eval/*` metrics under that
  step, and a failing or hanging evaluator is a logged error, never a crashed run.
Lifecycle (base.py): build -> `async with evaluator:` (opens what it owns) -> `evaluate(step)` at
each eval point -> `drain()` waits for what still runs -> exit closes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles_env.plugins import PluginTable

if TYPE_CHECKING:
    from miles_env.evals.base import EvalSetup, Evaluator

__all__ = ["EVAL_MODES", "build_evaluator"]

# eval.mode -> "module:class"; a class is `(EvalSetup) -> Evaluator`
EVAL_MODES = PluginTable(
    "eval mode",
    {
        "shared": "miles_env.evals.shared:SharedEval",
        "dedicated": "miles_env.evals.dedicated:DedicatedEval",
        "external": "miles_env.evals.external:ExternalEval",
    },
)


def build_evaluator(setup: EvalSetup) -> Evaluator:
    """The evaluator of `setup.cfg.eval.mode` (nothing opened yet)."""
    evaluator: Evaluator = EVAL_MODES.load(setup.cfg.eval.mode)(setup)
    return evaluator
