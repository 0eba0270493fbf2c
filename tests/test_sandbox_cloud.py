"""Cloud providers (e2b, daytona, modal, agentenv).

With credentials in the environment, the shared contract runs against each real
service; without, those classes skip with the reason. Always: the mapping logic
(spec -> SDK create params, SDK results -> ExecResult, SDK errors -> our errors,
timeouts) runs against fakes at the SDK seam (the cloud services are what we
cannot reach). The fake SDK sandboxes run the provider's real exec script in a
real local (bubblewrap) sandbox, so the framing is tested on a real shell.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
from sandbox_contract import SandboxContract, host_http_server  # noqa: F401

from miles_env.errors import SandboxError, SandboxThrottled, SandboxUnavailable
from miles_env.sandboxes import get_provider
from miles_env.sandboxes.agentenv import AgentEnvSandboxConfig, AgentEnvSandboxProvider
from miles_env.sandboxes.cloud import map_sdk_error
from miles_env.sandboxes.daytona import DaytonaSandboxConfig, DaytonaSandboxProvider
from miles_env.sandboxes.e2b import E2BSandboxConfig, E2BSandboxProvider
from miles_env.sandboxes.local import LocalSandboxConfig, LocalSandboxProvider
from miles_env.sandboxes.modal import ModalSandboxConfig, ModalSandboxProvider
from miles_env.types import NetworkPolicy, Resources, SandboxSpec

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- a fake E2B SDK whose sandboxes are real local sandboxes ---------------------------------------


class RateLimitException(Exception):
    pass


class TimeoutException(Exception):
    pass


class SandboxNotFoundException(Exception):
    pass


class FakeE2B:
    """The e2b module surface the adapter uses: AsyncSandbox.create/list/kill, SandboxQuery."""

    def __init__(self, local: LocalSandboxProvider, fail_create: list[Exception] | None = None) -> None:
        self.local, self.fail_create = local, fail_create or []
        self.created: list[dict[str, Any]] = []
        self.live: dict[str, Any] = {}
        fake = self

        class AsyncSandbox:
            def __init__(self, inner: Any, metadata: dict[str, str]) -> None:
                self.inner, self.metadata, self.sandbox_id = inner, metadata, "e2b-" + inner.id
                self.commands = SimpleNamespace(run=self.run)

            @classmethod
            async def create(cls, **params: Any) -> AsyncSandbox:
                fake.created.append(params)
                if fake.fail_create:
                    raise fake.fail_create.pop(0)
                sb = cls(await fake.local.create(SandboxSpec()), params["metadata"])
                fake.live[sb.sandbox_id] = sb
                return sb

            async def run(self, script: str, timeout: float) -> Any:
                if self.sandbox_id not in fake.live:
                    raise SandboxNotFoundException(f"sandbox {self.sandbox_id} not found")
                r = await self.inner.exec(script, timeout=timeout)
                return SimpleNamespace(exit_code=r.exit_code, stdout=r.stdout, stderr=r.stderr)

            async def kill(self) -> None:
                fake.live.pop(self.sandbox_id, None)
                await self.inner.close()

            @staticmethod
            def list(query: Any, api_key: str | None) -> Any:
                items = [
                    SimpleNamespace(sandbox_id=k, metadata=v.metadata)
                    for k, v in fake.live.items()
                    if all(v.metadata.get(a) == b for a, b in query.metadata.items())
                ]

                class Page:
                    has_next = True

                    async def next_items(self) -> list[Any]:
                        Page.has_next = False
                        return items

                return Page()

            @staticmethod
            async def kill_id(sandbox_id: str, api_key: str | None = None) -> None:
                await fake.live[sandbox_id].kill()

        AsyncSandbox.kill_by_id = AsyncSandbox.kill_id  # type: ignore[attr-defined]
        self.AsyncSandbox = AsyncSandbox
        self.SandboxQuery = lambda metadata: SimpleNamespace(metadata=metadata)


@pytest.fixture
def local(tmp_path) -> LocalSandboxProvider:
    return LocalSandboxProvider(LocalSandboxConfig(root_dir=str(tmp_path / "local")))


def _e2b(local: LocalSandboxProvider, **kw: Any) -> tuple[E2BSandboxProvider, FakeE2B]:
    fake = FakeE2B(local, kw.pop("fail_create", None))
    provider = E2BSandboxProvider(E2BSandboxConfig(api_key="k", **kw), sdk=fake)

    async def kill(sandbox_id: str, api_key: str | None = None) -> None:  # AsyncSandbox.kill(id) in the SDK
        await fake.live[sandbox_id].kill()

    provider.adapter.delete_id = kill  # type: ignore[method-assign]
    return provider, fake


class _RefusesAnotherUser:
    """A cloud sandbox's contract for `exec(user=)`: the SDKs run every command as the template's
    user, so an exec for another is refused in one line, never run as the template's."""

    async def test_an_exec_runs_as_the_user_it_names(self, provider):
        async with await provider.create(SandboxSpec()) as sb:
            with pytest.raises(SandboxError, match="exec as user 'nobody'.*local or docker provider"):
                await sb.exec("touch ran", user="nobody")
            assert (await sb.exec("test -e ran")).exit_code != 0


class TestFramingContractOverFakeE2B(_RefusesAnotherUser, SandboxContract):
    """The full contract through the e2b provider's framing, executed by a real shell."""

    @pytest.fixture
    def provider(self, local):
        return _e2b(local, expose_url="https://proxy.example")[0]

    # An E2B sandbox's image is its template: E2B applies the template's ENV, user and workdir
    # itself, the service's behaviour that no double here can stand for; the framing adds only
    # the spec's own env (test_e2b_create_params_and_labels). Its setuid files likewise.
    test_the_image_environment_applies_to_every_exec = None
    test_an_image_setuid_helper_acts_as_in_docker_and_gains_no_more = None

    async def test_the_writable_root_is_within_the_disk_quota(self, provider):
        """E2B's disk is its template's size, set when the template is built, not per sandbox:
        what the framing bounds is each file, at disk_mb (a larger one is killed_by_limit disk)."""
        async with await provider.create(SandboxSpec(resources=Resources(disk_mb=8, timeout_s=60))) as sb:
            r = await sb.exec("mkdir -p /opt/fill && head -c 16777216 /dev/zero > /opt/fill/one")
            assert r.killed_by_limit == "disk", r
            small = await sb.exec("rm -f /opt/fill/one && echo x > /opt/small && cat /opt/small")
            assert small.stdout == "x\n", small

    async def test_expose_reaches_host_http(self, provider, host_http_server):  # noqa: F811
        # A cloud sandbox reaches the host through the configured public URL of the proxy.
        async with await provider.create(SandboxSpec()) as sb:
            assert (
                await sb.expose("http://127.0.0.1:1234/s/abc/v1?x=1") == "https://proxy.example/s/abc/v1?x=1"
            )


async def test_limits_through_framing(local):
    provider, _ = _e2b(local)
    spec = SandboxSpec(resources=Resources(output_bytes=1 << 12, memory_mb=256, disk_mb=1))
    async with await provider.create(spec) as sb:
        flood = await sb.exec("head -c 100000000 /dev/zero | tr '\\0' x; echo never")
        assert flood.truncated and flood.killed_by_limit == "output" and len(flood.stdout) == 1 << 12
        assert (await sb.exec(["python3", "-c", "bytearray(1 << 30)"])).killed_by_limit == "memory"
        assert (await sb.exec("head -c 5000000 /dev/zero > big")).killed_by_limit == "disk"
        assert (await sb.exec("kill -9 $$")).exit_code == -9


async def test_e2b_create_params_and_labels(local):
    provider, fake = _e2b(local, image="my-template", ttl_s=600)
    spec = SandboxSpec(env={"A": "1"}, network=NetworkPolicy.NONE)
    async with await provider.create(spec):
        pass
    params = fake.created[0]
    assert params["template"] == "my-template" and params["timeout"] == 600
    assert params["envs"] == {"A": "1"} and params["allow_internet_access"] is False
    assert params["metadata"]["miles-env.managed"] == "1"
    assert params["metadata"]["miles-env.owner-pid"] == str(os.getpid())
    async with await provider.create(SandboxSpec(image="other")):
        pass
    assert fake.created[1]["template"] == "other"


async def test_e2b_error_mapping_and_gone_sandbox(local):
    provider, fake = _e2b(local, fail_create=[RateLimitException("429: rate limit")])
    with pytest.raises(SandboxThrottled, match="rate limit"):
        await provider.create(SandboxSpec())
    sb = await provider.create(SandboxSpec())
    await fake.live[sb.id].kill()  # the sandbox disappears mid-episode
    with pytest.raises(SandboxError, match="disappeared"):
        await sb.exec("true")
    await sb.close()


async def test_e2b_reaper_removes_dead_owners(local):
    provider, fake = _e2b(local)
    sb = await provider.create(SandboxSpec())
    assert await provider.reap() == []
    fake.live[sb.id].metadata["miles-env.owner-pid"] = "999999999"  # a crashed run's
    assert await provider.reap() == [sb.id] and fake.live == {}
    await sb.close()


def test_error_mapping_by_name():
    assert isinstance(map_sdk_error(RateLimitException("slow down"), "x"), SandboxThrottled)
    assert isinstance(
        map_sdk_error(type("DaytonaRateLimitError", (Exception,), {})("q"), "x"), SandboxThrottled
    )
    assert isinstance(
        map_sdk_error(type("AuthenticationException", (Exception,), {})("no"), "x"), SandboxUnavailable
    )
    assert "timed out" in str(map_sdk_error(TimeoutException("t"), "x"))
    assert "disappeared" in str(map_sdk_error(SandboxNotFoundException("gone"), "x"))


async def test_backend_that_never_answers_is_a_timeout_error(local, monkeypatch):
    provider, _ = _e2b(local, exec_margin_s=0.5)
    sb = await provider.create(SandboxSpec())

    async def hang(handle: Any, script: str, timeout: float) -> Any:
        await anyio.sleep(3600)

    monkeypatch.setattr(provider.adapter, "run", hang)
    with pytest.raises(SandboxError, match="no answer"):
        await sb.exec("true", timeout=0.01)
    monkeypatch.undo()
    await sb.close()


async def test_create_timing_out(local):
    provider, fake = _e2b(local, create_timeout_s=0.2)

    async def slow(**params: Any) -> Any:
        await anyio.sleep(3600)

    fake.AsyncSandbox.create = slow
    with pytest.raises(SandboxError, match="timed out"):
        await provider.create(SandboxSpec())


# -- the other SDKs' mapping ------------------------------------------------------------------------


class _Record:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def test_daytona_create_params():
    sdk = SimpleNamespace(
        CreateSandboxFromImageParams=_Record,
        CreateSandboxFromSnapshotParams=_Record,
        Resources=_Record,
        DaytonaConfig=_Record,
        AsyncDaytona=lambda cfg: cfg,
    )
    p = DaytonaSandboxProvider(DaytonaSandboxConfig(api_key="k", ttl_s=3600, cpus=1.5), sdk=sdk)
    params = p.adapter.create_params(
        SandboxSpec(image="img", env={"A": "1"}, resources=Resources(memory_mb=1500)), {"l": "v"}
    )
    assert params.image == "img" and params.labels == {"l": "v"} and params.env_vars == {"A": "1"}
    assert params.network_block_all is True and params.auto_stop_interval == 60
    assert (params.resources.cpu, params.resources.memory) == (2, 2)
    snap = p.adapter.create_params(SandboxSpec(), {})
    assert not hasattr(snap, "image")


async def test_daytona_exec_mapping_through_a_real_shell(local):
    inner = await local.create(SandboxSpec())

    class Process:
        async def exec(self, command: str, cwd: str, timeout: int) -> Any:
            r = await inner.exec(command, timeout=timeout)
            return SimpleNamespace(exit_code=r.exit_code, result=r.stdout + r.stderr)  # one combined stream

    class Client:
        async def create(self, params: Any, timeout: float) -> Any:
            return SimpleNamespace(id="d1", process=Process())

        async def delete(self, handle: Any) -> None:
            await inner.close()

    sdk = SimpleNamespace(CreateSandboxFromSnapshotParams=_Record)
    p = DaytonaSandboxProvider(DaytonaSandboxConfig(api_key="k"), sdk=sdk)
    p.adapter._client = Client()
    async with await p.create(SandboxSpec()) as sb:
        r = await sb.exec("echo out; echo err >&2; exit 4")
        assert (r.exit_code, r.stdout, r.stderr) == (4, "out\n", "err\n")
        t = await sb.exec("sleep 30", timeout=0.5)
        assert t.timed_out and t.exit_code == -9


def test_modal_create_params():
    sdk = SimpleNamespace(
        Image=SimpleNamespace(from_registry=lambda i: ("registry", i), debian_slim=lambda: "slim")
    )
    p = ModalSandboxProvider(ModalSandboxConfig(ttl_s=100, cpus=2), sdk=sdk)
    params = p.adapter.create_params(SandboxSpec(image="python:3.12", resources=Resources(memory_mb=512)))
    assert params["image"] == ("registry", "python:3.12") and params["block_network"] is True
    assert (params["timeout"], params["cpu"], params["memory"]) == (100, 2, 512)
    assert p.adapter.create_params(SandboxSpec(network=NetworkPolicy.HOST))["image"] == "slim"


def test_agentenv_create_params():
    p = AgentEnvSandboxProvider(AgentEnvSandboxConfig(ttl_s=50), provider=object())
    params = p.adapter.create_params(
        SandboxSpec(image="img", env={"A": "1"}, resources=Resources(memory_mb=300))
    )
    assert params == {
        "image_name": "img",
        "port": 8000,
        "env": {"A": "1"},
        "cpu": 1.0,
        "memory": 300,
        "timeout": 50,
    }


def test_missing_credentials_are_named(monkeypatch):
    for var in ("E2B_API_KEY", "DAYTONA_API_KEY", "MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET", "AGENTENV_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    for name, var in (
        ("e2b", "E2B_API_KEY"),
        ("daytona", "DAYTONA"),
        ("modal", "MODAL_TOKEN_ID"),
        ("agentenv", "AGENTENV"),
    ):
        with pytest.raises(SandboxUnavailable, match=var):
            get_provider(name)


# -- the real services, when credentials are set ------------------------------------------------------

_REAL = {
    "e2b": ("E2B_API_KEY",),
    "daytona": ("DAYTONA_API_KEY",),
    "modal": ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET"),
    "agentenv": ("AGENTENV_BACKEND",),
}


@pytest.fixture(params=sorted(_REAL))
def real_provider(request):
    name = request.param
    missing = [v for v in _REAL[name] if not os.environ.get(v)]
    if missing:
        pytest.skip(f"{name}: credentials not set ({', '.join(missing)})")
    try:
        return get_provider(name, expose_url=os.environ.get("MILES_ENV_EXPOSE_URL"))
    except SandboxUnavailable as e:
        pytest.skip(f"{name}: {e}")


class TestRealCloudContract(_RefusesAnotherUser, SandboxContract):
    @pytest.fixture
    def provider(self, real_provider):
        return real_provider

    # the image is the service's template (E2B, Daytona, Modal images, AgentEnv backends): its
    # ENV/USER/WORKDIR (and setuid files) are the service's to apply; the contract's own image
    # fixture is a local rootfs
    test_the_image_environment_applies_to_every_exec = None
    test_an_image_setuid_helper_acts_as_in_docker_and_gains_no_more = None

    async def test_expose_reaches_host_http(self, provider, host_http_server):  # noqa: F811
        pytest.skip(
            "a cloud sandbox reaches this host only through a public proxy URL (MILES_ENV_EXPOSE_URL)"
        )
