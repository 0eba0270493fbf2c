"""Engines placed by Ray: `cluster.engines` starts N engine servers as actors on engine nodes.

Concept: each `EngineServer` actor builds the run's engine (`engine:` section, any kind) on its
node and serves it over the SGLang native API (engines/sglang_server.py) on the node's IP. For the
embedded hf engine that is the engine itself, on the node's CPUs (or GPU); for `engine.kind=sglang`
or `vllm` with launch, the actor launches the server process on its node (`engines.gpus` reserves
the GPUs it needs) and serves it through the same API, so the driver and the workers see one shape
whatever runs underneath. The actors are placed with SPREAD and `engines.resources` (e.g.
{"engine": 1} on engine nodes). `PlacedEngines` is the job's engine: an `SGLangEngine` client over
every actor's URL (sticky by session on its own ring, or behind sglang-router with
`engines.router`), so weight sync goes to every engine in parallel after each step and each one's
time is in the step's metrics (`sync_s_engine{i}`); the rollout workers reach the same URLs on
their own rings (driver.py). Weights travel by disk (`update_weights_from_disk` of the trainer's
export under RUN_DIR/weights): the run directory must be on storage every engine node reads.

Faults: an engine actor that dies is an engine that fails its /health: it leaves the clients'
rings (SGLangEngine), its turns in flight fail as EngineErrors (the episodes are ABORTED, recorded),
and the run goes on with the others; it is not replaced.

Lifecycle: `placed_engines(cfg, engine_cfg, model_dir)` joins the cluster, starts the actors and
waits until each serves; `PlacedEngines.close()` stops the router, closes and kills the actors and
leaves the cluster if it joined it. `summary()` (in RUN_DIR/cluster.json) lists each engine's
node, URL and the weight version it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
from pydantic import BaseModel, ConfigDict

from miles_env.cluster import session
from miles_env.config import RunConfig
from miles_env.engines import EngineConfig
from miles_env.engines.sglang import SGLangEngine
from miles_env.errors import ClusterError, EngineError

__all__ = ["EngineSpec", "EngineServer", "PlacedEngines", "placed_engines"]

log = logging.getLogger(__name__)

CLOSE_S = 30.0


class EngineSpec(BaseModel):
    """What an engine actor builds and where it listens; sent to the actor as JSON."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    engine: EngineConfig
    host: str | None = None  # default: the node's IP as Ray sees it


class EngineServer:
    """The actor's class (wrapped with `ray.remote` by `placed_engines`): one engine, served."""

    def __init__(self, spec_json: str) -> None:
        self.spec = EngineSpec.model_validate_json(spec_json)
        self.url = ""
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._holder: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None

    async def start(self) -> tuple[str, str]:
        """Build the engine and serve it; return (its URL, this node's Ray id)."""
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        self._holder = asyncio.get_running_loop().create_task(self._hold())
        await self._ready.wait()
        if self._failure is not None:
            raise self._failure
        return self.url, node_id

    async def _hold(self) -> None:
        import ray

        from miles_env.engines import build_engine
        from miles_env.engines.sglang_server import running_server

        engine = None
        try:
            engine = await build_engine(self.spec.engine)
            host = self.spec.host or ray.util.get_node_ip_address()
            async with running_server(engine, host=host, port=0) as url:
                self.url = url
                self._ready.set()
                await self._stop.wait()
        except Exception as e:  # a failed start is start()'s error, on the driver
            self._failure = e
            self._ready.set()
        finally:
            if engine is not None:
                await engine.close()

    async def close(self) -> None:
        """Stop serving and close the engine (a launched server process with it)."""
        self._stop.set()
        if self._holder is not None:
            with contextlib.suppress(Exception):
                await self._holder


class PlacedEngines(SGLangEngine):
    """The job's engine over the placed actors; closing it stops them (module docstring)."""

    def __init__(
        self, urls: Sequence[str], actors: Sequence[Any], nodes: Sequence[str], *, joined: bool, **kw: Any
    ) -> None:
        super().__init__(urls, **kw)
        self.engine_urls = list(self.urls)  # every placed engine, also once one has left the ring
        self.nodes = list(nodes)
        self._actors = list(actors)
        self._joined = joined

    async def summary(self) -> list[dict[str, Any]]:
        """Per engine: name, node, URL, in the ring still, and the weight version it serves now."""
        out = []
        for i, (url, node) in enumerate(zip(self.engine_urls, self.nodes, strict=True)):
            try:
                answer = await self._request("GET", f"{url}/get_weight_version", timeout=5.0)
                version = answer.json()["weight_version"]
            except (EngineError, ValueError, KeyError):
                version = None
            live = url in self.urls
            out.append(
                {"name": f"engine-{i}", "node_id": node, "url": url, "live": live, "weight_version": version}
            )
        return out

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            with anyio.CancelScope(shield=True):
                await _stop(self._actors)
            session.leave(self._joined)


async def _stop(actors: Sequence[Any]) -> None:
    import ray

    for actor in actors:
        with anyio.move_on_after(CLOSE_S), contextlib.suppress(ray.exceptions.RayActorError):
            await actor.close.remote()
        ray.kill(actor, no_restart=True)


async def _start(cfg: RunConfig, engine_cfg: EngineConfig) -> tuple[list[Any], list[tuple[str, str]]]:
    """The engine actors, each serving: (actors, [(url, node id)])."""
    import ray

    c = cfg.cluster
    assert c.engines is not None
    e = c.engines
    actor_cls = ray.remote(EngineServer).options(
        num_cpus=e.cpus, num_gpus=e.gpus, resources=dict(e.resources), scheduling_strategy="SPREAD",
        max_restarts=0, max_task_retries=0,
    )  # fmt: skip
    actors: list[Any] = [
        actor_cls.remote(EngineSpec(name=f"engine-{i}", engine=engine_cfg).model_dump_json())
        for i in range(e.count)
    ]
    try:
        with anyio.fail_after(c.start_timeout_s):
            served = [await a.start.remote() for a in actors]  # started concurrently, awaited in order
    except BaseException as err:
        for a in actors:
            ray.kill(a, no_restart=True)
        if isinstance(err, TimeoutError):
            need = {"CPU": e.cpus, "GPU": e.gpus, **e.resources}
            raise ClusterError(
                f"cluster.engines.count={e.count}: not all started within "
                f"cluster.start_timeout_s={c.start_timeout_s:g}; does the cluster offer {need} to each?"
            ) from None
        raise
    return actors, [(str(url), str(node)) for url, node in served]


async def placed_engines(cfg: RunConfig, engine_cfg: EngineConfig, model_dir: Path | None) -> PlacedEngines:
    """Join the cluster, start `cluster.engines.count` engine actors, return the client over them."""
    assert cfg.cluster.address is not None and cfg.cluster.engines is not None
    joined = session.join(cfg.cluster.address)
    try:
        actors, served = await _start(cfg, engine_cfg)
    except BaseException:
        session.leave(joined)
        raise
    urls, nodes = [u for u, _ in served], [n for _, n in served]
    log.info("engines placed by Ray: %s", ", ".join(f"{u} (node {n[:8]})" for u, n in served))
    kw: dict[str, Any] = {"model_dir": model_dir}
    if cfg.cluster.engines.router == "sglang-router":
        from miles_env.engines.router import start_router
        from miles_env.http import free_port

        port = free_port()
        try:
            router = await start_router(urls, port, cfg.run_dir / "engine" / f"sglang-router-{port}.log")
        except BaseException:
            await _stop(actors)
            session.leave(joined)
            raise
        kw.update(router=router.spec.url, servers=[router])
    return PlacedEngines(urls, actors, nodes, joined=joined, **kw)
