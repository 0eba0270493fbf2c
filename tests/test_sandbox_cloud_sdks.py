"""The cloud providers' mapping code against the real SDK packages (installed by setup, no credentials).

The fake SDKs in test_sandbox_cloud.py check our logic; these check that what we call still exists
in the SDK versions requirements.lock pins, with the parameters we pass: an SDK upgrade that renames
a parameter or a method fails here, not in a user's first cloud run.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from miles_env.sandboxes.daytona import DaytonaAdapter, DaytonaSandboxConfig
from miles_env.sandboxes.e2b import E2BAdapter, E2BSandboxConfig
from miles_env.sandboxes.modal import ModalAdapter, ModalSandboxConfig
from miles_env.types import NetworkPolicy, Resources, SandboxSpec

SPEC = SandboxSpec(
    image="python:3.12-slim", env={"A": "1"}, network=NetworkPolicy.NONE, resources=Resources(memory_mb=2048)
)


def _bind(fn: Any, *args: Any, **kwargs: Any) -> None:
    """Call-compatibility: the parameters exist by name; keys a **kwargs takes must be in its TypedDict."""
    sig = inspect.signature(fn)
    sig.bind(*args, **kwargs)  # TypeError names the parameter the SDK no longer takes
    var_kw = next((p for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    if var_kw is not None:
        unpacked = getattr(var_kw.annotation, "__args__", (var_kw.annotation,))[0]
        allowed = set(getattr(unpacked, "__annotations__", {}))
        extra = set(kwargs) - set(sig.parameters) - allowed
        assert not extra, f"{fn.__qualname__} takes none of {sorted(extra)}"


def test_e2b_create_list_kill_match_the_sdk():
    import e2b

    adapter = E2BAdapter(E2BSandboxConfig(api_key="k", domain="example.invalid"), e2b)
    _bind(e2b.AsyncSandbox.create, **adapter.create_params(SPEC, {"miles-env.managed": "1"}))
    query = e2b.SandboxQuery(metadata={"miles-env.managed": "1"})
    _bind(e2b.AsyncSandbox.list, query=query, api_key="k")
    _bind(e2b.AsyncSandbox.kill, "sandbox-id", api_key="k")
    for name in ("commands", "kill", "sandbox_id"):
        assert (
            name in dir(e2b.AsyncSandbox) or name in inspect.signature(e2b.AsyncSandbox.__init__).parameters
        )


@pytest.mark.parametrize("image", ["python:3.12-slim", None])
def test_daytona_params_build_with_the_real_models(image):
    import daytona

    adapter = DaytonaAdapter(DaytonaSandboxConfig(api_key="k", cpus=1.5), daytona)
    spec = SPEC.model_copy(update={"image": image})
    params = adapter.create_params(spec, {"miles-env.managed": "1"})  # the SDK's own pydantic models
    assert params.labels == {"miles-env.managed": "1"} and params.network_block_all is True
    _bind(daytona.AsyncDaytona.create, params, timeout=60)
    _bind(daytona.DaytonaConfig, api_key="k", api_url=None, target=None)


def test_modal_create_matches_the_sdk():
    import modal

    adapter = ModalAdapter(ModalSandboxConfig(cpus=2), modal)
    params = adapter.create_params(SPEC)
    assert isinstance(params["image"], modal.Image)
    _bind(modal.Sandbox.create.aio, "sleep", "infinity", app=None, **params)
    for name in ("from_id", "list", "set_tags", "terminate", "exec"):
        assert hasattr(modal.Sandbox, name), name
