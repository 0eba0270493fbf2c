"""The fake engine server of the proxy benchmarks: zero model cost behind two APIs.

- SGLang's native API (`POST /generate` and friends, miles_env.engines.sglang_server) over a
  ScriptedEngine that emits `--echo` filler tokens per call: what TITO's `sglang` engine calls.
- A minimal OpenAI-compatible `POST /v1/chat/completions`: parses the request and answers a
  fixed completion of the same filler text, without rendering or tokenizing the messages: what
  a client calls directly, and what LiteLLM's `openai/` provider forwards to.

Run in its own process so that neither proxy nor client shares its event loop:

    python bench/fake_engine.py --port PORT [--echo 8]      # prints "ready" once it accepts
"""

from __future__ import annotations

import argparse
import json
import time

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse

from miles_env.engines.base import SamplingParams
from miles_env.engines.scripted import ScriptedEngine
from miles_env.engines.sglang_server import create_app
from miles_env.http import loop_options, serve_app
from miles_env.models import load_tokenizer


async def build_app(echo: int):  # noqa: ANN201 - a FastAPI app
    tok = load_tokenizer()
    engine = ScriptedEngine(tok, echo_tokens=echo, max_context=65536, record=False)
    app = create_app(engine)
    gen = await engine.generate([1], SamplingParams(max_new_tokens=64))
    reply = tok.decode(gen.output_ids, skip_special_tokens=True)  # the text /generate would give

    async def chat_completions(request: Request) -> JSONResponse:
        body = json.loads(await request.body())
        prompt = sum(len(str(m.get("content") or "")) for m in body["messages"]) // 4
        return JSONResponse(
            {
                "id": "chatcmpl-fake",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", "fake"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": reply},
                        "finish_reason": "stop",
                        "logprobs": None,
                    }
                ],
                "usage": {"prompt_tokens": prompt, "completion_tokens": echo, "total_tokens": prompt + echo},
            }
        )

    app.router.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    return app


async def main(port: int, echo: int) -> None:
    async with serve_app(await build_app(echo), port=port):
        print("ready", flush=True)
        await anyio.sleep_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--echo", type=int, default=8)
    a = ap.parse_args()
    anyio.run(main, a.port, a.echo, backend_options=loop_options())
