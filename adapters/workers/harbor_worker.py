"""Harbor worker: runs Harbor's own Trial (agent + verifier) on a miles-env sandbox.

Methods: `trial {sandbox, task_dir, agent, trials_dir}` runs `Trial.create(TrialConfig(...))`
with the environment `harbor_env:MilesSandboxEnvironment` (import_path), whose
commands run in the host's sandbox `sandbox` through callbacks; returns Harbor's
verifier rewards. `agent` is a Harbor agent name (`oracle`, `nop`, ...).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from _rpc import serve

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


async def trial(params: dict[str, Any]) -> dict[str, Any]:
    from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig
    from harbor.trial.trial import Trial
    from harbor_env import CURRENT_SANDBOX

    CURRENT_SANDBOX.set(params["sandbox"])
    config = TrialConfig(
        task=TaskConfig(path=Path(params["task_dir"])),
        trials_dir=Path(params["trials_dir"]),
        agent=AgentConfig(name=params.get("agent", "oracle")),
        environment=EnvironmentConfig(import_path="harbor_env:MilesSandboxEnvironment", delete=False),
    )
    t = await Trial.create(config)
    result = await t.run()
    vr = result.verifier_result
    return {
        "rewards": dict(vr.rewards or {}) if vr is not None else None,
        "exception": str(result.exception_info) if getattr(result, "exception_info", None) else None,
        "trial_uri": result.trial_uri,
    }


if __name__ == "__main__":
    t0 = time.perf_counter()
    import harbor

    serve(
        {"trial": trial},
        {
            "framework": "harbor",
            "version": getattr(harbor, "__version__", "?"),
            "import_s": time.perf_counter() - t0,
        },
    )
