"""One HTTP request to an inference server, with every fault typed as an EngineError.

Shared by the clients of remote engines (sglang.py, vllm.py). A timeout, a dropped connection
or an HTTP status >= 500 becomes `EngineError("<kind> <url>: ...")`: transient, the rollout ends
that one episode with the reason and the run goes on. A 400 (or 422) is the server refusing the
request itself, which no retry can fix: it becomes `EngineRefused` carrying the server's own
message, with reason "context_length" and the prompt length and limit when the message is one
of the context refusals below, else reason "invalid_request".

The error bodies come from the servers' source: SGLang's native API answers
`{"error": {"message"}}` for a refused /generate and `{"object": "error", "message", ...}` for a
malformed body; vLLM answers `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import re
from typing import Any

import httpx

from miles_env.errors import EngineError, EngineRefused

__all__ = ["request", "refusal"]

# The context refusals of the servers we speak to, each naming the prompt length and the limit.
_CONTEXT = [
    # SGLang tokenizer_manager._validate_one_request: prompt + max_new_tokens >= context length
    r"maximum context length of (?P<limit>\d+) tokens\. You requested a total of \d+ tokens: "
    r"(?P<prompt>\d+) tokens from the input",
    # SGLang tokenizer_manager._validate_one_request: prompt >= context length
    r"The input \((?P<prompt>\d+) tokens\) is longer than the model's context length \((?P<limit>\d+) tokens\)",
    # SGLang scheduler validate_input_length: prompt >= max_req_input_len
    r"Input length \((?P<prompt>\d+) tokens\)(?: of the \w+)? exceeds the [\w ]+? \((?P<limit>\d+) tokens\)",
    # vLLM input_processor._validate_prompt_len: prompt >= max_model_len
    r"prompt \(length (?P<prompt>\d+)\) (?:plus the number of requested output tokens \(at least 1\) )?"
    r"is longer than the maximum model length of (?P<limit>\d+)",
    # vLLM renderer (OpenAI-compatible endpoints)
    r"maximum context length is (?P<limit>\d+) tokens\. However, your prompt contains (?:at least )?"
    r"(?P<prompt>\d+) input tokens",
    r"maximum context length is (?P<limit>\d+) tokens\. However, you requested \d+ tokens \((?P<prompt>\d+) in",
]
_CONTEXT_RE = [re.compile(p) for p in _CONTEXT]


def _message(resp: httpx.Response) -> str:
    try:
        body: Any = resp.json()
    except ValueError:
        return resp.text[:500]
    if isinstance(body, dict):
        err = body.get("error")
        for holder in (err, body):
            if isinstance(holder, dict):
                for key in ("message", "detail"):
                    if isinstance(holder.get(key), str):
                        return str(holder[key])
        if isinstance(err, str):
            return err
    return resp.text[:500]


def refusal(message: str) -> EngineRefused:
    """The EngineRefused a server's refusal message stands for (context refusals parsed)."""
    for pattern in _CONTEXT_RE:
        if m := pattern.search(message):
            return EngineRefused(message, "context_length", int(m["prompt"]), int(m["limit"]))
    return EngineRefused(message, "invalid_request")


async def request(client: httpx.AsyncClient, kind: str, method: str, url: str, **kw: Any) -> httpx.Response:
    try:
        resp = await client.request(method, url, **kw)
    except httpx.TimeoutException as e:
        raise EngineError(f"{kind} {url}: timed out ({type(e).__name__})") from e
    except httpx.HTTPError as e:
        raise EngineError(f"{kind} {url}: {type(e).__name__}: {str(e) or 'connection lost'}") from e
    if resp.status_code in (400, 422):
        raise refusal(_message(resp))
    if resp.status_code >= 400:
        raise EngineError(f"{kind} {url}: HTTP {resp.status_code}: {resp.text[:500]}")
    return resp
