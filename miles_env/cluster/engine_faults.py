"""A dead engine actor is replaced (`cluster.engines.replace`): watched, placed, loaded, joined.

Concept: `watch_engines` runs in the driver's background for the whole run (driver.py). Every
`WATCH_S` it asks each live engine's /health; one that fails it asks Ray too (an actor call):
the engine is dead only when Ray says its actor is gone, so a busy engine is never replaced.
Why a periodic probe rather than the first EngineError: in a cluster run the driver sends no
/generate (the workers do, on their own clients), so the driver would see a death only at the next
weight sync; a /health per engine per second is cheap and independent of the traffic.
The dead one leaves the driver's ring and, at once, the rollout workers' (so no more of their
sessions start there; a turn a worker sends before that fails and its episode is ABORTED, as
without replacement); a replacement (`engine-{n}`, same spec, same resources,
SPREAD: where Ray finds room) is placed within `cluster.start_timeout_s`, else logged and given
up (the run goes on with the others).

Invariant (zero-KL): a replacement joins no ring before it serves the weights every other engine
serves. The driver's client records what each sync loaded (`PlacedEngines.served`: the export
kept aside by served.py's `keep_served`, hard links, since the trainer's next export overwrites the folder;
or the LoRA adapter) and every sync holds `PlacedEngines.sync_lock`; the replacement loads
`served` and joins under that same lock, so no sync can fall between its load and its join, and
every later sync reaches it. Then the driver hands the new list of live URLs to every rollout
worker (`RolloutWorker.set_engine_urls`); a worker started later gets the current list.

Lifecycle: `watch_engines` returns only when cancelled (the run's end); a replacement being placed
then is killed. RUN_DIR/cluster.json lists each engine with whom it replaced and at which version
it joined (`PlacedEngines.summary`), and `engines_replaced`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio
import httpx

from miles_env.cluster.engines import Placed, PlacedEngines, start_engine
from miles_env.cluster.served import Served
from miles_env.engines._http import request
from miles_env.errors import ClusterError, EngineError

__all__ = ["OnChange", "watch_engines", "replace_engine"]

log = logging.getLogger(__name__)

WATCH_S = 1.0  # between two health rounds

OnChange = Callable[[list[str]], Awaitable[None]]  # the live engine URLs, after a replacement joined


async def watch_engines(engines: PlacedEngines, on_change: OnChange) -> None:
    """Replace each placed engine that dies, for as long as the run lasts (module docstring)."""
    async with anyio.create_task_group() as tg:
        while True:
            await anyio.sleep(WATCH_S)
            for p in [p for p in engines.placed if p.live]:
                reason = await engines.dead_reason(p)
                if reason is not None:
                    await engines.lose(p, reason)
                    if engines.engine_urls:  # the workers stop sending sessions there at once
                        await on_change(engines.engine_urls)
                    tg.start_soon(replace_engine, engines, p, on_change)


async def replace_engine(engines: PlacedEngines, dead: Placed, on_change: OnChange) -> None:
    """Place, load and join one engine for `dead`; a failure is logged and the run goes on."""
    name = engines.next_name()
    timeout = engines.cfg.cluster.start_timeout_s
    try:
        with anyio.fail_after(timeout):
            new = await start_engine(engines.cfg, engines.engine_cfg, name)
            try:
                async with engines.sync_lock, httpx.AsyncClient(timeout=timeout) as client:
                    new.joined_version = await _load_served(client, engines.served, new)
                    new.replaces = dead.name
                    await engines.join(new)
            except BaseException:
                import ray

                ray.kill(new.actor, no_restart=True)
                raise
    except TimeoutError:
        log.warning(
            "engine %s not replaced: not serving within cluster.start_timeout_s=%g", dead.name, timeout
        )
        return
    except (ClusterError, EngineError, OSError) as e:
        log.warning("engine %s not replaced: %s", dead.name, e)
        return
    except Exception as e:  # a failed actor start (RayActorError, the engine's build error): recorded
        log.warning("engine %s not replaced: %s: %s", dead.name, type(e).__name__, e)
        return
    log.warning(
        "engine %s replaced by %s (%s, node %s) at weight version %s",
        dead.name, new.name, new.url, new.node_id[:8], new.joined_version,
    )  # fmt: skip
    await on_change(engines.engine_urls)


async def _load_served(client: httpx.AsyncClient, served: Served | None, new: Placed) -> int:
    """Bring `new` to the weights the others serve (`served`, the last sync's); return that version."""
    if served is None:
        return 0  # no sync yet: it serves the weights it was built with, as the others do
    version = str(served.version)
    if served.lora_name is not None:
        path, body = "/load_lora_adapter", {
            "lora_name": served.lora_name, "lora_path": str(served.path), "weight_version": version,
        }  # fmt: skip
    else:
        path, body = "/update_weights_from_disk", {"model_path": str(served.path), "weight_version": version}
    answer = (await request(client, "sglang", "POST", f"{new.url}{path}", json=body)).json()
    if not answer.get("success", False):
        raise EngineError(f"{new.url}{path}: {answer.get('message') or answer.get('error_message')}")
    if served.lora_name is not None:  # a real SGLang takes the version from its own route
        await request(
            client, "sglang", "POST", f"{new.url}/update_weight_version", json={"new_version": version}
        )
    answer = (await request(client, "sglang", "GET", f"{new.url}/get_weight_version")).json()
    now = str(answer.get("weight_version"))
    if now != version and not (served.version == 0 and now == "default"):
        raise EngineError(f"{new.url}: serves weight version {now!r} after loading {version}")
    return served.version
