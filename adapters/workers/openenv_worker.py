"""OpenEnv worker: serves an OpenEnv environment server on loopback and drives it with GenericEnvClient.

Usage: python openenv_worker.py TARGET, TARGET is "http://host:port" (a running env
server) or "module:attr" / "path/file.py:attr" naming a FastAPI app built with
openenv's create_app (or a zero-argument function returning one). A file is imported as
openenv's server would import it: from its project root (nearest folder, up to 3 levels up,
with openenv.yaml; else its own folder) put first on sys.path, by its dotted module name
(`server.app`), so its sibling modules import (the rule of adapters/openenv.py `project_root`).
"""

from __future__ import annotations

import asyncio
import importlib
import socket
import sys
import time
from pathlib import Path
from typing import Any

from _rpc import serve

TARGET = sys.argv[1]
_state: dict[str, Any] = {"url": None, "server": None}
_clients: dict[str, Any] = {}


def _project_root(file: Path) -> Path:
    for folder in list(file.parents)[:3]:
        if (folder / "openenv.yaml").is_file():
            return folder
    return file.parent


def _load(target: str) -> Any:
    mod_name, _, attr = target.rpartition(":")
    if mod_name.endswith(".py"):
        file = Path(mod_name).resolve()
        root = _project_root(file)
        sys.path.insert(0, str(root))
        module = importlib.import_module(".".join(file.relative_to(root).with_suffix("").parts))
    else:
        module = importlib.import_module(mod_name)
    obj = getattr(module, attr)
    return obj if hasattr(obj, "router") else obj()


async def _url() -> str:
    if _state["url"]:
        return _state["url"]
    if TARGET.startswith(("http://", "https://")):
        _state["url"] = TARGET.rstrip("/")
        return _state["url"]
    import uvicorn

    app = _load(TARGET)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    _state["server"] = server
    asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.02)
    _state["url"] = f"http://127.0.0.1:{port}"
    return _state["url"]


async def info(params: dict[str, Any]) -> dict[str, Any]:
    import httpx

    url = await _url()
    async with httpx.AsyncClient() as c:
        schema = (await c.get(f"{url}/schema")).json()
    return {"url": url, "schema": schema}


def _result(r: Any) -> dict[str, Any]:
    obs = r.observation if isinstance(r.observation, dict) else dict(r.observation)
    return {"observation": obs, "reward": r.reward, "done": bool(r.done)}


async def reset(params: dict[str, Any]) -> dict[str, Any]:
    from openenv.core.generic_client import GenericEnvClient

    client = GenericEnvClient(base_url=await _url())
    await client.connect()
    _clients[params["session"]] = client
    return _result(await client.reset(**params.get("kwargs", {})))


async def step(params: dict[str, Any]) -> dict[str, Any]:
    return _result(await _clients[params["session"]].step(params["action"]))


async def close(params: dict[str, Any]) -> bool:
    client = _clients.pop(params["session"], None)
    if client is not None:
        await client.close()
    return True


if __name__ == "__main__":
    import openenv

    t0 = time.perf_counter()
    serve(
        {"info": info, "reset": reset, "step": step, "close": close},
        {
            "framework": "openenv",
            "version": getattr(openenv, "__version__", "?"),
            "import_s": time.perf_counter() - t0,
        },
    )
