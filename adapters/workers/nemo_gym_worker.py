"""NeMo Gym worker: a resources server, NeMo Gym's simple_agent and its OpenAI model server, in process.

Usage: python nemo_gym_worker.py RESOURCES_SERVER [DATA_JSONL]. RESOURCES_SERVER names a
package under `resources_servers` (shipped with nemo-gym, e.g. `mcqa`) or a path to an
`app.py` defining a `SimpleResourcesServer` subclass. Rows come from DATA_JSONL
(default: the server's `data/example.jsonl`). All servers run on this worker's event
loop with uvicorn on loopback (no head server, no `ng_run`, no network): the resources
server once; per episode a model server (`openai_model`, Responses API) pointed at
the episode's TITO session and a `simple_agent`, whose `POST /run` seeds the session,
runs the agent loop and calls the resources server's `/verify` (the reward).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from _rpc import serve

# Why: nemo-gym reads its global config from this variable, else it parses the
# command line with hydra (and exits); an empty config keeps every default.
os.environ.setdefault("NEMO_GYM_CONFIG_DICT", "{}")
TARGET = sys.argv[1]
DATA = sys.argv[2] if len(sys.argv) > 2 else ""
_state: dict[str, Any] = {}


def _free_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


async def _serve(app: Any) -> tuple[Any, int]:
    import uvicorn

    sock = _free_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.02)
    return server, sock.getsockname()[1]


def _module() -> Any:
    if TARGET.endswith(".py"):
        path = Path(TARGET).resolve()
        sys.path.insert(0, str(path.parent))
        spec = importlib.util.spec_from_file_location(f"nemo_res_{path.parent.name}", path)
        assert spec is not None and spec.loader is not None, f"cannot import {path}"
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(f"resources_servers.{TARGET}.app")


def _data_path(module: Any) -> Path:
    return Path(DATA) if DATA else Path(module.__file__).parent / "data" / "example.jsonl"


def _client(servers: dict[str, tuple[str, str, dict[str, Any]]]) -> Any:
    from nemo_gym.config_types import BaseServerConfig
    from nemo_gym.server_utils import ServerClient
    from omegaconf import OmegaConf

    cfg = {name: {kind: {impl: conf}} for name, (kind, impl, conf) in servers.items()}
    return ServerClient(
        head_server_config=BaseServerConfig(host="127.0.0.1", port=1),
        global_config_dict=OmegaConf.create(cfg),
    )


async def _resources() -> dict[str, Any]:
    if "res" in _state:
        return _state["res"]  # type: ignore[no-any-return]
    from nemo_gym.base_resources_server import SimpleResourcesServer

    module = _module()
    cls: Any = next(
        v
        for v in vars(module).values()
        if inspect.isclass(v) and issubclass(v, SimpleResourcesServer) and v.__module__ == module.__name__
    )
    cfg_cls = cls.model_fields["config"].annotation
    sock_port = _free_socket().getsockname()[1]
    conf = {
        "host": "127.0.0.1",
        "port": sock_port,
        "entrypoint": "app.py",
        "name": "resources",
        "domain": "other",
    }
    server = cls(config=cfg_cls.model_validate(conf), server_client=_client({}))
    _, port = await _serve(server.setup_webserver())
    conf["port"] = port
    _state["res"] = {"conf": conf, "cls": cls.__name__, "module": module}
    return _state["res"]  # type: ignore[no-any-return]


async def tasks(params: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in _data_path(_module()).read_text().splitlines() if line.strip()]
    out = []
    for i, row in enumerate(rows):
        inp = row.get("responses_create_params", {}).get("input")
        prompt = inp if isinstance(inp, str) else "\n".join(str(m.get("content", "")) for m in inp or [])
        out.append({"idx": i, "id": str(row.get("uuid") or row.get("id") or f"row-{i}"), "prompt": prompt})
    return out


async def run(params: dict[str, Any]) -> dict[str, Any]:
    import httpx
    from responses_api_agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
    from responses_api_models.openai_model.app import SimpleModelServer, SimpleModelServerConfig

    res = await _resources()
    row = json.loads(_data_path(res["module"]).read_text().splitlines()[params["idx"]])
    model_conf = {
        "host": "127.0.0.1",
        "port": 0,
        "entrypoint": "app.py",
        "name": "policy_model",
        "openai_base_url": params["base_url"],
        "openai_api_key": params["api_key"],
        "openai_model": params["model"],
    }
    model = SimpleModelServer(
        config=SimpleModelServerConfig.model_validate(model_conf), server_client=_client({})
    )
    m_server, model_conf["port"] = await _serve(model.setup_webserver())
    agent_conf = {
        "host": "127.0.0.1",
        "port": 0,
        "entrypoint": "app.py",
        "name": "agent",
        "max_steps": params.get("max_steps", 4),
        "resources_server": {"type": "resources_servers", "name": "resources"},
        "model_server": {"type": "responses_api_models", "name": "policy_model"},
    }
    servers = {
        "resources": ("resources_servers", "res", res["conf"]),
        "policy_model": ("responses_api_models", "openai_model", model_conf),
    }
    agent = SimpleAgent(config=SimpleAgentConfig.model_validate(agent_conf), server_client=_client(servers))
    a_server, agent_conf["port"] = await _serve(agent.setup_webserver())
    servers["agent"] = ("responses_api_agents", "simple_agent", agent_conf)
    agent.server_client = _client(servers)
    try:
        async with httpx.AsyncClient(timeout=params.get("timeout", 600)) as c:
            r = await c.post(f"http://127.0.0.1:{agent_conf['port']}/run", json=row)
        if r.status_code != 200:
            raise RuntimeError(f"simple_agent /run: HTTP {r.status_code}: {r.text[:1000]}")
        body = r.json()
    finally:
        for s in (a_server, m_server):
            s.should_exit = True
    response = body.get("response") or {}
    text = "".join(
        c.get("text", "")
        for o in response.get("output", [])
        if o.get("type") == "message"
        for c in o.get("content", [])
    )
    extra = {
        k: v for k, v in body.items() if k not in ("response", "responses_create_params") and _jsonable(v)
    }
    return {"reward": float(body["reward"]), "answer": text, "verify": extra}


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


if __name__ == "__main__":
    t0 = time.perf_counter()
    import nemo_gym

    serve(
        {"tasks": tasks, "run": run},
        {
            "framework": "nemo-gym",
            "version": getattr(nemo_gym, "__version__", "?"),
            "import_s": time.perf_counter() - t0,
        },
    )
