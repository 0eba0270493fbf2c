"""The built-in terminal agent.

A small loop that works with a 135M model: the model answers in plain text with
one shell command in a code block (no tool template needed); the harness runs
it in the sandbox and sends back the output, until the model gives no command,
says DONE, or the turn budget ends. It talks to the model only through the TITO
session URL, with the official `openai` client, so every token is captured.
"""

from __future__ import annotations

import re
from typing import Any

from miles_env.harness import Endpoint, HarnessResult
from miles_env.harnesses.configs import BuiltinConfig
from miles_env.sandbox import Sandbox
from miles_env.types import EpisodeEnd, ExecResult, Status, Task

__all__ = ["BuiltinConfig", "BuiltinHarness", "parse_command", "format_observation"]

# One worked example, given as prior turns: small models copy its format.
FEW_SHOT: tuple[dict[str, str], ...] = (
    {"role": "user", "content": "Create a file named pet.txt containing the word cat."},
    {"role": "assistant", "content": "```sh\necho cat > pet.txt\n```"},
    {"role": "user", "content": "Exit code: 0\nOutput:\n(none)"},
    {"role": "assistant", "content": "DONE"},
)

_FENCE = re.compile(r"```[a-zA-Z0-9_+-]*[ \t]*\n(.*?)(?:```|$)", re.DOTALL)


def parse_command(text: str) -> str | None:
    """The shell command in a reply: the first fenced block, else the first `$ ` line; None if DONE."""
    stripped = text.strip()
    if not stripped or stripped.upper().startswith("DONE"):
        return None
    m = _FENCE.search(text)
    if m:
        body = "\n".join(line[2:] if line.startswith("$ ") else line for line in m.group(1).splitlines())
        return body.strip() or None
    for line in stripped.splitlines():
        if line.startswith("$ "):
            return line[2:].strip() or None
    return None


def format_observation(result: ExecResult, limit: int) -> str:
    out = (result.stdout + result.stderr).strip()
    if len(out) > limit:
        out = out[:limit] + "\n[output truncated]"
    status = f"Exit code: {result.exit_code}"
    if result.timed_out:
        status += " (timed out)"
    elif result.killed_by_limit:
        status += f" (killed: {result.killed_by_limit} limit)"
    return f"{status}\nOutput:\n{out or '(none)'}"


def _exec_record(command: str, result: ExecResult, limit: int) -> dict[str, Any]:
    output = (result.stdout + result.stderr).strip()
    return {
        "command": command,
        "exit_code": result.exit_code,
        "duration_s": round(result.duration_s, 4),
        "output": output[:limit],  # what the model was shown, at most
        "timed_out": result.timed_out,
        "killed_by_limit": result.killed_by_limit,
    }


class BuiltinHarness:
    name = "builtin"

    def __init__(self, config: BuiltinConfig | None = None, **overrides: Any) -> None:
        base = (config or BuiltinConfig()).model_dump()
        self.config = BuiltinConfig(**{**base, **overrides})

    def _initial_messages(self, task: Task) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.config.system_prompt}]
        if self.config.few_shot:
            messages.extend(dict(m) for m in FEW_SHOT)
        messages.append({"role": "user", "content": task.instruction})
        return messages

    async def run(self, task: Task, sandbox: Sandbox, endpoint: Endpoint) -> HarnessResult:
        import openai

        cfg = self.config
        client = openai.AsyncOpenAI(
            base_url=endpoint.base_url,
            api_key=endpoint.api_key,
            max_retries=cfg.retries,
            timeout=cfg.request_timeout_s,
        )
        messages = self._initial_messages(task)
        execs: list[dict[str, Any]] = []  # what ran, as the sandbox reported it (the viewer shows it)

        def meta() -> dict[str, Any]:
            return {"commands": len(execs), "execs": execs}

        try:
            for _ in range(cfg.max_turns):
                try:
                    resp = await client.chat.completions.create(
                        model=endpoint.model,
                        messages=messages,  # type: ignore[arg-type]
                        max_tokens=cfg.max_tokens,
                        temperature=cfg.temperature,
                        top_p=cfg.top_p,
                    )
                except openai.BadRequestError as e:  # a session budget (context, tokens, turns) was hit
                    return HarnessResult(Status.TRUNCATED, messages, f"budget: {e.message}", meta())
                except openai.APIConnectionError as e:  # no answer in time (a stalled engine, a timeout)
                    error = f"model call failed: {e}"
                    return HarnessResult(Status.ABORTED, messages, error, meta(), EpisodeEnd.ENGINE_ERROR)
                except openai.APIError as e:  # the proxy failed it (its fault record says why): aborted
                    return HarnessResult(Status.ABORTED, messages, f"model call failed: {e}", meta())
                content = resp.choices[0].message.content or ""
                messages.append({"role": "assistant", "content": content})
                command = parse_command(content)
                if command is None:
                    return HarnessResult(Status.COMPLETED, messages, None, meta())
                result = await sandbox.exec(command, timeout=cfg.command_timeout_s)
                execs.append(_exec_record(command, result, cfg.observation_chars))
                messages.append(
                    {"role": "user", "content": format_observation(result, cfg.observation_chars)}
                )
            return HarnessResult(Status.TRUNCATED, messages, "max turns reached", meta())
        finally:
            await client.close()
