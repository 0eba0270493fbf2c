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
and the run goes on with the others. With `engines.replace` (the default) the driver watches the
actors and replaces a dead one (engine_faults.py): a new actor, same spec, loads the weights the
others serve (`served`, recorded by each sync under `sync_lock`) and only then joins the rings
(this client's, the router's, every rollout worker's), so no turn is sampled from stale weights.

Lifecycle: `placed_engines(cfg, engine_cfg, model_dir)` joins the cluster, starts the actors and
waits until each serves; `PlacedEngines.close()` stops the router, closes and kills the actors
(replacements too) and leaves the cluster if it joined it. `summary()` (in RUN_DIR/cluster.json)
lists each engine's node, URL, the weight version it serves, the generations it served, and for a
replacement whom it replaced and at which version it joined.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from pydantic import BaseModel, ConfigDict

from miles_env.cluster import session
from miles_env.cluster.config import EnginesConfig
from miles_env.cluster.served import Served, keep_served
from miles_env.config import RunConfig
from miles_env.engines import EngineConfig
from miles_env.engines.sglang import SGLangEngine
from miles_env.errors import ClusterError, EngineError

__all__ = [
    "EngineSpec",
    "EngineServer",
    "Placed",
    "PlacedEngines",
    "placed_engines",
    "start_engine",
]

log = logging.getLogger(__name__)

CLOSE_S = 30.0
PROBE_S = 10.0  # an actor call that says whether Ray still has it


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
        self._engine: Any = None

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
            engine = self._engine = await build_engine(self.spec.engine)
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

    async def requests(self) -> int | None:
        """Generations this engine served (None: its kind does not count them); also Ray's liveness probe."""
        from miles_env.engines.base import PrefixCacheCounter

        engine = self._engine
        return engine.prefix_cache_stats().requests if isinstance(engine, PrefixCacheCounter) else None

    async def close(self) -> None:
        """Stop serving and close the engine (a launched server process with it)."""
        self._stop.set()
        if self._holder is not None:
            with contextlib.suppress(Exception):
                await self._holder


@dataclass(slots=True)
class Placed:
    """One engine actor of the run: where it serves and what became of it."""

    name: str
    actor: Any  # ray.actor.ActorHandle of EngineServer
    url: str
    node_id: str
    live: bool = True
    lost_error: str | None = None
    replaces: str | None = None  # the dead engine this one was started for
    joined_version: int | None = None  # the weight version it served when it joined the rings


class PlacedEngines(SGLangEngine):
    """The job's engine over the placed actors; closing it stops them (module docstring)."""

    def __init__(
        self, placed: Sequence[Placed], cfg: RunConfig, engine_cfg: EngineConfig, *, joined: bool, **kw: Any
    ) -> None:
        super().__init__([p.url for p in placed], **kw)
        self.placed = list(placed)
        self.cfg, self.engine_cfg = cfg, engine_cfg
        self.served: Served | None = None  # None: the engines serve the weights they were built with
        self.sync_lock = anyio.Lock()  # a weight sync and a replacement joining never interleave
        self._joined = joined
        self._named = len(self.placed)  # engines named so far: a replacement is engine-{n}

    def next_name(self) -> str:
        """The name of the next replacement (unique even while several are being placed)."""
        self._named += 1
        return f"engine-{self._named - 1}"

    @property
    def engine_urls(self) -> list[str]:
        """Every live placed engine's URL (what the rollout workers' rings hold)."""
        return [p.url for p in self.placed if p.live]

    async def update_weights_from_disk(self, path: str | Path, weight_version: int | None = None) -> int:
        async with self.sync_lock:
            version = await super().update_weights_from_disk(path, weight_version)
            if self.replaces:  # the next export may overwrite `path`: keep what is served now
                self.served = Served(version, await anyio.to_thread.run_sync(keep_served, Path(path)))
            return version

    async def load_lora_adapter(self, lora_name: str, lora_path: str | Path, weight_version: int) -> int:
        async with self.sync_lock:
            version = await super().load_lora_adapter(lora_name, lora_path, weight_version)
            self.served = Served(version, Path(lora_path), lora_name)  # kept until the next sync's load
            return version

    @property
    def replaces(self) -> bool:
        """`cluster.engines.replace`: a dead engine is replaced (engine_faults.py)."""
        return self.cfg.cluster.engines is not None and self.cfg.cluster.engines.replace

    async def dead_reason(self, p: Placed) -> str | None:
        """Why `p` is dead: its /health fails and Ray says its actor is gone; None while it lives
        (a failing /health of a live actor, e.g. busy, is not a death)."""
        import ray

        if not await self._is_down(p.url):
            return None
        try:
            with anyio.fail_after(PROBE_S):
                await p.actor.requests.remote()
        except ray.exceptions.RayActorError as e:
            return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        except TimeoutError:
            return None
        return None

    async def lose(self, p: Placed, reason: str) -> None:
        """Mark `p` dead and take it out of this client's ring (the last URL stays: SGLangEngine)."""
        p.live, p.lost_error = False, reason
        log.warning("engine %s (%s, node %s) lost: %s", p.name, p.url, p.node_id[:8], reason)
        await self._drop_if_down(p.url, reason=f"engine actor lost: {reason}")

    async def join(self, p: Placed) -> None:
        """Add `p` (serving the current weights; the caller holds `sync_lock`) to the ring and the
        router: every later sync reaches it."""
        if self.router is not None:
            from miles_env.engines.router import router_add

            await router_add(self._client, self.router, p.url)
        self.placed.append(p)
        self.set_urls([*(u for u in self.urls if u in self.engine_urls), p.url])

    async def summary(self) -> list[dict[str, Any]]:
        """Per engine: name, node, URL, live, the weight version it serves now, the generations it
        served (`requests`), whom it replaced (and at which version it joined), why it was lost."""
        out = []
        for p in self.placed:
            try:
                answer = await self._request("GET", f"{p.url}/get_weight_version", timeout=5.0)
                version = answer.json()["weight_version"]
            except (EngineError, ValueError, KeyError):
                version = None
            out.append({
                "name": p.name, "node_id": p.node_id, "url": p.url, "live": p.live,
                "weight_version": version, "requests": await _requests(p) if p.live else None,
                "replaces": p.replaces, "joined_version": p.joined_version, "lost_error": p.lost_error,
            })  # fmt: skip
        return out

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            with anyio.CancelScope(shield=True):
                await _stop([p.actor for p in self.placed])
            session.leave(self._joined)


async def _requests(p: Placed) -> int | None:
    import ray

    try:
        with anyio.fail_after(PROBE_S):
            count: int | None = await p.actor.requests.remote()
            return count
    except (TimeoutError, ray.exceptions.RayActorError):
        return None


async def _stop(actors: Sequence[Any]) -> None:
    import ray

    for actor in actors:
        with anyio.move_on_after(CLOSE_S), contextlib.suppress(ray.exceptions.RayActorError):
            await actor.close.remote()
        ray.kill(actor, no_restart=True)


def _actor_cls(e: EnginesConfig) -> Any:
    """EngineServer as a Ray actor: `engines`' resources, spread over the nodes, never restarted by Ray."""
    import ray

    return ray.remote(EngineServer).options(
        num_cpus=e.cpus, num_gpus=e.gpus, resources=dict(e.resources), scheduling_strategy="SPREAD",
        max_restarts=0, max_task_retries=0,
    )  # fmt: skip


async def start_engine(cfg: RunConfig, engine_cfg: EngineConfig, name: str) -> Placed:
    """One more engine actor, placed and serving (in no ring yet); killed if it fails or is cancelled."""
    import ray

    assert cfg.cluster.engines is not None
    actor = _actor_cls(cfg.cluster.engines).remote(EngineSpec(name=name, engine=engine_cfg).model_dump_json())
    try:
        url, node = await actor.start.remote()
    except BaseException:
        ray.kill(actor, no_restart=True)
        raise
    return Placed(name, actor, str(url), str(node))


async def _start(cfg: RunConfig, engine_cfg: EngineConfig) -> list[Placed]:
    """The first `engines.count` actors, started concurrently, each serving."""
    c = cfg.cluster
    assert c.engines is not None
    e = c.engines
    placed: list[Placed | None] = [None] * e.count
    try:
        with anyio.fail_after(c.start_timeout_s):
            async with anyio.create_task_group() as tg:
                for i in range(e.count):
                    tg.start_soon(_place, cfg, engine_cfg, placed, i)
    except BaseException as err:
        await _stop([p.actor for p in placed if p is not None])
        if isinstance(err, TimeoutError):
            need = {"CPU": e.cpus, "GPU": e.gpus, **e.resources}
            raise ClusterError(
                f"cluster.engines.count={e.count}: not all started within "
                f"cluster.start_timeout_s={c.start_timeout_s:g}; does the cluster offer {need} to each?"
            ) from None
        raise
    return [p for p in placed if p is not None]


async def _place(cfg: RunConfig, engine_cfg: EngineConfig, placed: list[Placed | None], i: int) -> None:
    placed[i] = await start_engine(cfg, engine_cfg, f"engine-{i}")


async def placed_engines(cfg: RunConfig, engine_cfg: EngineConfig, model_dir: Path | None) -> PlacedEngines:
    """Join the cluster, start `cluster.engines.count` engine actors, return the client over them."""
    assert cfg.cluster.address is not None and cfg.cluster.engines is not None
    joined = session.join(cfg.cluster.address)
    try:
        placed = await _start(cfg, engine_cfg)
    except BaseException:
        session.leave(joined)
        raise
    urls = [p.url for p in placed]
    log.info("engines placed by Ray: %s", ", ".join(f"{p.url} (node {p.node_id[:8]})" for p in placed))
    kw: dict[str, Any] = {"model_dir": model_dir}
    if cfg.cluster.engines.router == "sglang-router":
        from miles_env.engines.router import start_router
        from miles_env.http import free_port

        port = free_port()
        try:
            router = await start_router(urls, port, cfg.run_dir / "engine" / f"sglang-router-{port}.log")
        except BaseException:
            await _stop([p.actor for p in placed])
            session.leave(joined)
            raise
        kw.update(router=router.spec.url, servers=[router])
    return PlacedEngines(placed, cfg, engine_cfg, joined=joined, **kw)
