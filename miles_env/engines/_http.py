"""One HTTP request to an inference server, with every transport fault as an EngineError.

Shared by the clients of remote engines (sglang.py, vllm.py): a timeout, a dropped
connection or an HTTP status >= 400 becomes `EngineError("<kind> <url>: ...")`, so the
rollout ends that one episode with the reason and the run goes on.
"""

from __future__ import annotations

from typing import Any

import httpx

from miles_env.errors import EngineError

__all__ = ["request"]


async def request(client: httpx.AsyncClient, kind: str, method: str, url: str, **kw: Any) -> httpx.Response:
    try:
        resp = await client.request(method, url, **kw)
    except httpx.TimeoutException as e:
        raise EngineError(f"{kind} {url}: timed out ({type(e).__name__})") from e
    except httpx.HTTPError as e:
        raise EngineError(f"{kind} {url}: {type(e).__name__}: {str(e) or 'connection lost'}") from e
    if resp.status_code >= 400:
        raise EngineError(f"{kind} {url}: HTTP {resp.status_code}: {resp.text[:500]}")
    return resp
