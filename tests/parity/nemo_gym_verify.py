"""NeMo Gym's own /verify on a recorded reply: the resources server's verify endpoint, called directly.

argv: IN.json {"server", "idx", "reply"} OUT.json {"reward", "verify"}. The row is the server's own
example data row `idx`; the reply becomes a Responses API response (one assistant message),
as NeMo Gym's simple_agent hands it to /verify.
"""

import asyncio
import json
import sys

p = json.loads(open(sys.argv[1]).read())
out_path = sys.argv[2]
sys.argv = [sys.argv[0], p["server"]]  # the worker module reads its target from argv

import nemo_gym_worker as ng  # noqa: E402  (adapters/workers on PYTHONPATH: the same server start)


async def main() -> None:
    import httpx

    res = await ng._resources()
    row = json.loads(ng._data_path(res["module"]).read_text().splitlines()[p["idx"]])
    message = {
        "type": "message", "id": "msg_parity", "role": "assistant", "status": "completed",
        "content": [{"type": "output_text", "text": p["reply"], "annotations": []}],
    }  # fmt: skip
    response = {
        "id": "resp_parity", "created_at": 0, "model": "parity", "object": "response", "output": [message],
        "parallel_tool_calls": False, "tool_choice": "auto", "tools": [],
    }  # fmt: skip
    async with httpx.AsyncClient(timeout=120) as c:
        r = await c.post(f"http://127.0.0.1:{res['conf']['port']}/verify", json={**row, "response": response})
    r.raise_for_status()
    body = r.json()
    open(out_path, "w").write(json.dumps({"reward": body["reward"], "verify": body.get("extracted_answer")}))


asyncio.run(main())
