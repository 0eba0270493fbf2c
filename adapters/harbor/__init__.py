"""Harbor: task directories read natively, and Harbor's own Trial run on our sandboxes.

One concern per module: `taskdir.py` reads a Harbor task directory into a Task
(task.toml's sections, a malformed folder reported, not fatal); `steps.py` holds the
multi-step semantics; `environment.py` runs tasks and verifies an episode as Harbor's
verifier does (no harbor package needed); `dockerfile.py` honours a task's
`environment/Dockerfile` without a container build where possible; `trial.py` drives the
harbor package (in its own venv, behind the worker) so Harbor's agent and verifier run in
one of our sandboxes (`--harness framework`, `run_harbor_trial`).
"""

from __future__ import annotations

from miles_env.adapters.harbor.environment import (
    HARBOR_ROOT,
    HarborTasksEnvironment,
    TaskProblem,
    find_task_dirs,
    parse_reward,
    parse_rewards,
    read_task_dir,
    rebase_paths,
    run_harbor_trial,
)
from miles_env.adapters.harbor.trial import run_episode, trial_in_sandbox

__all__ = [
    "HARBOR_ROOT",
    "HarborTasksEnvironment",
    "TaskProblem",
    "find_task_dirs",
    "parse_reward",
    "parse_rewards",
    "read_task_dir",
    "rebase_paths",
    "run_episode",
    "run_harbor_trial",
    "trial_in_sandbox",
]
