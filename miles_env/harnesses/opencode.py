"""The `opencode` harness: the real opencode CLI (npm `opencode-ai`), unmodified, acting inside the sandbox.

Lifecycle of one run: install (cached) -> mount the install dir read-only ->
expose the TITO session's `/v1` inside the sandbox -> write an opencode config
(one custom provider on `@ai-sdk/openai-compatible`, key from an env var) ->
`opencode run --format json --title ID --auto TASK` -> exit status and opencode's
JSON events into the metadata.

opencode speaks OpenAI chat completions (`POST {baseURL}/chat/completions`,
streamed) and offers its own tools (`bash`, `read`, `write`, `edit`, ...); they
run in the sandbox because the CLI itself runs there. Why the flags and
variables: an explicit `--title` stops opencode's extra title-generation request
(it would share the session and the policy's turn count); no model list fetch,
no autoupdate, no auto-compaction and no pruning of old tool outputs, so each
request carries the previous one's history unchanged and nothing but the agent's
own turns reaches the model; `--auto` approves tool permissions (bwrap is the sandbox).
"""

from __future__ import annotations

import json
import time
from typing import Any

from miles_env.harness import Endpoint, HarnessResult
from miles_env.harnesses._cli import HOME, cli_result, cli_status, ensure_cli, mount_cli, run_cli, tested_pin
from miles_env.harnesses.configs import OpencodeConfig
from miles_env.sandbox import Sandbox
from miles_env.types import Status, Task

__all__ = ["OpencodeConfig", "OpencodeHarness", "opencode_config"]

CONFIG_PATH = f"{HOME}/opencode.json"
KEY_VAR = "TITO_API_KEY"
PROVIDER = "tito"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def opencode_config(
    base_url: str,
    model: str,
    *,
    context_tokens: int | None = None,
    output_tokens: int | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """opencode.json pointing opencode at `base_url` (…/v1) as model `tito/<model>`, key from $TITO_API_KEY."""
    entry: dict[str, Any] = {"name": model, "tool_call": True}
    if context_tokens is not None or output_tokens is not None:
        entry["limit"] = {"context": context_tokens or 0, "output": output_tokens or 0}
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "name": PROVIDER,
        "options": {"baseURL": base_url, "apiKey": f"{{env:{KEY_VAR}}}"},
        "models": {model: entry},
    }
    config: dict[str, Any] = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {PROVIDER: provider},
        "model": f"{PROVIDER}/{model}",
        "autoupdate": False,
        "share": "disabled",
    }
    return {**config, **(extra or {})}


def parse_events(stdout: str) -> list[dict[str, Any]]:
    out = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict):
                out.append(event)
    return out


def final_text(events: list[dict[str, Any]]) -> str | None:
    """The text of opencode's last `text` event (its final answer), if any."""
    for ev in reversed(events):
        part = ev.get("part")
        if ev.get("type") == "text" and isinstance(part, dict) and isinstance(part.get("text"), str):
            return str(part["text"])
    return None


def failure(events: list[dict[str, Any]]) -> tuple[str, bool] | None:
    """opencode's own account of an error (its `error` event): (message, whether a session budget ran out)."""
    for ev in reversed(events):
        if ev.get("type") != "error":
            continue
        err = ev.get("error")
        data = err.get("data") if isinstance(err, dict) else None
        data = data if isinstance(data, dict) else {}
        try:
            body = json.loads(str(data.get("responseBody") or "{}"))
        except json.JSONDecodeError:
            body = {}
        code = body.get("error", {}).get("code") if isinstance(body, dict) else None
        return str(data.get("message") or err)[:400], code == "budget_exceeded"
    return None


class OpencodeHarness:
    name = "opencode"

    def __init__(self, config: OpencodeConfig | None = None, **overrides: Any) -> None:
        base = (config or OpencodeConfig()).model_dump()
        self.config = OpencodeConfig(**{**base, **overrides})
        self.pin = tested_pin("opencode", self.config.version)

    def argv(self, task: Task) -> list[str]:
        argv = self.pin.command(self.config.binary) + ["run", "--format", "json", "--auto"]
        argv += ["--title", task.id or "task"]
        return argv + list(self.config.extra_args) + [task.instruction]

    def env(self, endpoint: Endpoint) -> dict[str, str]:
        return {
            "PATH": DEFAULT_PATH,
            "HOME": HOME,
            "OPENCODE_CONFIG": CONFIG_PATH,
            KEY_VAR: endpoint.api_key,
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_AUTOCOMPACT": "1",
            "OPENCODE_DISABLE_PRUNE": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "OPENCODE_DISABLE_SHARE": "1",
            "NO_COLOR": "1",
            **dict(self.pin.env),
            **self.config.extra_env,
        }

    async def run(self, task: Task, sandbox: Sandbox, endpoint: Endpoint) -> HarnessResult:
        t0 = time.time()
        cfg = self.config
        install_dir = await ensure_cli(self.pin)
        mount_cli(sandbox, self.pin, install_dir)
        inner_v1 = await sandbox.expose(endpoint.base_url)
        await sandbox.exec(["mkdir", "-p", HOME], timeout=30)
        body = opencode_config(
            inner_v1,
            endpoint.model,
            context_tokens=cfg.context_tokens,
            output_tokens=cfg.output_tokens,
            extra=cfg.extra_config,
        )
        await sandbox.write_file(CONFIG_PATH, json.dumps(body, indent=2))
        prepared = time.time()
        run = await run_cli(sandbox, self.argv(task), self.env(endpoint), cfg.budget_s)
        status, error = cli_status(run, self.pin)
        events = parse_events(run.stdout)
        said = failure(events)
        if said is not None and status is not Status.TRUNCATED:
            # opencode reports a failed model call as an `error` event (and exits 1).
            message, budget = said
            status = Status.TRUNCATED if budget else Status.ABORTED
            error = f"{'budget' if budget else 'model call failed'}: {message}"
        final = final_text(events)
        return cli_result(
            self.pin, run, status, error, instruction=task.instruction, final=final, output=events,
            timing=(t0, prepared),
        )  # fmt: skip
