"""The LoRA routes of the embedded SGLang server (sglang_server.py): adapters loaded at run time.

LoRA (SGLang's entrypoints/http_server.py `load_lora_adapter`, io_struct.py
`LoadLoRAAdapterReqInput` / `LoRAUpdateOutput`): `{lora_name, lora_path, pinned}` in,
`{success, error_message, loaded_adapters: {name: path}}` out, 400 when it fails. Here the engine
(any with `load_lora_adapter`, e.g. hf) serves one adapter at a time, the last loaded, on every
request (a `lora_path` field of /generate is ignored); an extra `weight_version` field sets the
version the adapter is served as (RL clients send it; absent, the version is bumped).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from miles_env.engines.base import Engine
from miles_env.errors import EngineError

__all__ = ["LoraServing", "lora_routes"]


@runtime_checkable
class LoraServing(Protocol):
    """An engine that loads PEFT adapter dirs at run time (the hf engine)."""

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str | Path, weight_version: int | None = None
    ) -> int: ...


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # SGLang's request is a dataclass: unknown fields pass

    lora_name: str
    lora_path: str
    pinned: bool = False
    weight_version: str | None = None  # ours: the version the adapter is served as


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str


def lora_routes(app: FastAPI, engine: Engine) -> None:
    """Add /load_lora_adapter and /unload_lora_adapter to `app`, serving `engine`'s adapters."""
    loaded: dict[str, str] = {}

    def _out(ok: bool, error: str | None = None) -> JSONResponse:
        body = {"success": ok, "error_message": error, "loaded_adapters": dict(loaded)}
        return JSONResponse(body, status_code=200 if ok else 400)

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoraAdapterRequest) -> JSONResponse:
        if not isinstance(engine, LoraServing):
            return _out(False, f"LoRA is not enabled: engine {type(engine).__name__} cannot load adapters")
        if req.lora_name in loaded:  # SGLang's LoRARegistry refuses a name it already holds
            return _out(False, f"LoRA adapter {req.lora_name} is already loaded")
        version = int(req.weight_version) if req.weight_version is not None else None
        try:
            await engine.load_lora_adapter(req.lora_name, req.lora_path, version)
        except (EngineError, ValueError) as e:
            return _out(False, str(e))
        loaded[req.lora_name] = req.lora_path  # listed until unloaded; the engine serves the newest
        return _out(True)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoraAdapterRequest) -> JSONResponse:
        if loaded.pop(req.lora_name, None) is None:
            return _out(False, f"LoRA adapter {req.lora_name} is not loaded")
        return _out(True)
