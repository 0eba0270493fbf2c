"""Harbor worker: runs Harbor's own Trial (agent + verifier) on a miles-env sandbox.

Methods: `trial {sandbox, task_dir, agent, trials_dir, model?, agent_kwargs?}` runs
`Trial.create(TrialConfig(...))` with the environment
`harbor_env:MilesSandboxEnvironment` (import_path), whose commands run in the host's
sandbox `sandbox` through callbacks; returns Harbor's verifier rewards. `agent` is a
Harbor agent name (`oracle`, `nop`, `terminus-2`, ...). `model` ({base_url, api_key,
model}) points an LLM agent at an OpenAI-compatible endpoint (a TITO session): the
model name becomes `openai/<model>` for LiteLLM, `base_url` its `api_base`.

LiteLLM runs offline: the local model cost map, no telemetry, no callbacks home.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from _rpc import serve

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_TELEMETRY", "False")
os.environ.setdefault("LITELLM_LOG", "ERROR")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Our defaults for Harbor's LLM agents: no asciinema (it would try apt/pip, offline)
# and no proactive summarization (it needs the model's context size from LiteLLM's map).
_LLM_AGENT_DEFAULTS: dict[str, Any] = {
    "record_terminal_session": False,
    "proactive_summarization_threshold": 0,
}


def agent_config(params: dict[str, Any]) -> Any:
    from harbor.models.trial.config import AgentConfig

    name = params.get("agent", "oracle")
    model = params.get("model")
    timeout = params.get("agent_timeout_s")
    if model and not _takes_a_model(AgentConfig(name=name)):
        model = None  # oracle, nop: no model to point anywhere
    if not model:
        return AgentConfig(
            name=name, kwargs=dict(params.get("agent_kwargs") or {}), override_timeout_sec=timeout
        )
    kwargs = {**_LLM_AGENT_DEFAULTS, **(params.get("agent_kwargs") or {})}
    kwargs.setdefault("api_base", model["base_url"])
    kwargs.setdefault("llm_kwargs", {"api_key": model["api_key"]})
    return AgentConfig(
        name=name,
        model_name=f"openai/{model['model']}",
        base_url=model["base_url"],
        env={"OPENAI_API_KEY": model["api_key"], "OPENAI_BASE_URL": model["base_url"]},
        kwargs=kwargs,
        override_timeout_sec=timeout,
    )


def _takes_a_model(config: Any) -> bool:
    """Whether Harbor's agent accepts an inference endpoint (its capabilities.base_url)."""
    from harbor.agents.factory import AgentFactory

    cls = AgentFactory.get_agent_class_from_config(config)
    caps = getattr(cls, "capabilities", None)
    return bool(getattr(caps, "base_url", False))


async def trial(params: dict[str, Any]) -> dict[str, Any]:
    from harbor.models.trial.config import EnvironmentConfig, TaskConfig, TrialConfig
    from harbor.trial.trial import Trial
    from harbor_env import CURRENT_SANDBOX

    CURRENT_SANDBOX.set(params["sandbox"])
    config = TrialConfig(
        task=TaskConfig(path=Path(params["task_dir"])),
        trials_dir=Path(params["trials_dir"]),
        agent=agent_config(params),
        environment=EnvironmentConfig(import_path="harbor_env:MilesSandboxEnvironment", delete=False),
    )
    t = await Trial.create(config)
    result = await t.run()
    vr = result.verifier_result
    ar = result.agent_result
    exc = getattr(result, "exception_info", None)
    return {
        "exception_type": getattr(exc, "exception_type", None),
        "rewards": dict(vr.rewards or {}) if vr is not None else None,
        "exception": str(result.exception_info) if getattr(result, "exception_info", None) else None,
        "trial_uri": result.trial_uri,
        "agent": {
            "n_input_tokens": getattr(ar, "n_input_tokens", None),
            "n_output_tokens": getattr(ar, "n_output_tokens", None),
        },
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
