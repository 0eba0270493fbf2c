"""OpenEnv's own client on recorded actions: the app served by uvicorn, driven by GenericEnvClient.

argv: IN.json {"root", "module", "attr", "seed", "actions": [{field: text}, ...]} OUT.json
{"rewards": [...], "done": bool}. The app is imported from its project root, as `uvicorn
server.app:app` run there would.
"""

import asyncio
import importlib
import json
import socket
import sys


async def main() -> None:
    import uvicorn
    from openenv.core.generic_client import GenericEnvClient

    p = json.loads(open(sys.argv[1]).read())
    sys.path.insert(0, p["root"])
    app = getattr(importlib.import_module(p["module"]), p["attr"])
    app = app if hasattr(app, "router") else app()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.02)
    client = GenericEnvClient(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}")
    await client.connect()
    r = await client.reset(seed=p["seed"])
    rewards = []
    for action in p["actions"]:
        if r.done:
            break
        r = await client.step(action)
        rewards.append(r.reward or 0.0)
    await client.close()
    server.should_exit = True
    await task
    open(sys.argv[2], "w").write(json.dumps({"rewards": rewards, "done": bool(r.done)}))


asyncio.run(main())
