"""The sandbox commands of an episode, read back from its transcript.

A harness's transcript holds each command the model asked for and the result it was shown. Three
shapes are read: OpenAI chat `tool_calls` answered by `role: tool` messages, Anthropic `tool_use`
blocks answered by `tool_result` blocks (Claude Code), and the builtin harness's fenced shell block
answered by a user message "Exit code: N ...". An exit code is taken from the result's text when it
states one; a duration only when the harness recorded it (`duration_s` in the result).
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["commands_from_transcript"]

_EXIT = re.compile(r"(?:Exit code|exit code|exit_code|Exit status)[:=]\s*(-?\d+)")
_FENCE = re.compile(r"```(?:sh|bash|shell)?\s*\n(.*?)```", re.S)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            _text(c.get("text", c.get("content", ""))) if isinstance(c, dict) else str(c) for c in content
        )
    return "" if content is None else json.dumps(content)


def _command_of(name: str, args: Any) -> str:
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return args
    if isinstance(args, dict):
        for key in ("command", "cmd", "script", "code"):
            if isinstance(args.get(key), str | list):
                value = args[key]
                return " ".join(value) if isinstance(value, list) else value
        return f"{name} {json.dumps(args)}"
    return name


def _result(text: str, is_error: bool = False, duration: Any = None) -> dict[str, Any]:
    m = _EXIT.search(text)
    code = int(m.group(1)) if m else (1 if is_error else None)
    return {"exit_code": code, "output": text, "duration_s": duration}


def commands_from_transcript(transcript: list[Any]) -> list[dict[str, Any]]:
    """[{tool, command, exit_code, output, duration_s}] in the order the model issued them."""
    out: list[dict[str, Any]] = []
    pending: dict[str, dict[str, Any]] = {}
    last_shell: dict[str, Any] | None = None
    for msg in transcript:
        if not isinstance(msg, dict):
            continue
        role, content = msg.get("role"), msg.get("content")
        for call in msg.get("tool_calls") or []:  # OpenAI chat
            fn = call.get("function", {})
            cmd = {
                "tool": fn.get("name", ""),
                "command": _command_of(fn.get("name", ""), fn.get("arguments")),
            }
            cmd.update(exit_code=None, output=None, duration_s=None)
            out.append(cmd)
            pending[str(call.get("id"))] = cmd
        if role == "tool" and str(msg.get("tool_call_id")) in pending:
            pending.pop(str(msg.get("tool_call_id"))).update(_result(_text(content)))
            continue
        if isinstance(content, list):  # Anthropic blocks
            for block in content:
                if not isinstance(block, dict):
                    continue
                if block.get("type") == "tool_use":
                    cmd = {
                        "tool": block.get("name", ""),
                        "command": _command_of(block.get("name", ""), block.get("input")),
                    }
                    cmd.update(exit_code=None, output=None, duration_s=None)
                    out.append(cmd)
                    pending[str(block.get("id"))] = cmd
                elif block.get("type") == "tool_result" and str(block.get("tool_use_id")) in pending:
                    res = _result(_text(block.get("content")), bool(block.get("is_error")))
                    pending.pop(str(block.get("tool_use_id"))).update(res)
            continue
        if role == "assistant" and isinstance(content, str) and (m := _FENCE.search(content)):
            last_shell = {"tool": "shell", "command": m.group(1).strip(), "exit_code": None, "output": None,
                          "duration_s": None}  # fmt: skip
            out.append(last_shell)
        elif role == "user" and last_shell is not None and isinstance(content, str):
            last_shell.update(_result(content))
            last_shell = None
    return out
