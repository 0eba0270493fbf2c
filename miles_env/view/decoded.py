"""The conversation and the commands read back from the tokens, when the transcript lacks them.

A CLI harness (Claude Code, Codex, ...) records only the instruction and the final answer: the
turns in between exist only as the token ids the proxy stored. Here each turn of a sample is cut
at its recorded boundaries (Turn.start, completion_len) into the prompt text new since the previous
completion and the completion, decoded with the run's tokenizer for display. Tool calls are read
from the completion with the proxy's hermes parser (the `<tool_call>` blocks the text-action
fallback asks for) and paired, in order, with the `<tool_response>` blocks of the next prompt.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["decoded_turns", "commands_from_turns"]

_RESPONSE = re.compile(r"<tool_response>\s*(.*?)\s*</tool_response>", re.S)
_EXIT = re.compile(r"(?:Exit code|exit code|exit_code)[:=]?\s*(-?\d+)")


def decoded_turns(sample: dict[str, Any], decode: Callable[[Sequence[int]], str]) -> list[dict[str, Any]]:
    ids = sample["token_ids"]
    out, prev_end = [], 0
    for k, t in enumerate(sample.get("turns", [])):
        start, end = int(t["start"]), int(t["start"]) + int(t["completion_len"])
        out.append(
            {
                "turn": k,
                "weight_version": t.get("weight_version", 0),
                "finish_reason": t.get("finish_reason", ""),
                "prompt": decode(ids[prev_end:start]),
                "completion": decode(ids[start:end]),
            }
        )
        prev_end = end
    if prev_end < len(ids):
        out.append({"turn": None, "prompt": decode(ids[prev_end:]), "completion": ""})
    return out


def commands_from_turns(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from miles_env.tito.toolparse import parse_tool_calls

    cmds: list[dict[str, Any]] = []
    for k, turn in enumerate(turns):
        _, calls = parse_tool_calls(turn["completion"])
        results = _RESPONSE.findall(turns[k + 1]["prompt"]) if k + 1 < len(turns) else []
        for j, call in enumerate(calls):
            args = call.arguments_obj()
            command = args.get("command") if isinstance(args, dict) else None
            output = results[j] if j < len(results) else None
            code = _EXIT.search(output) if output else None
            cmds.append(
                {
                    "tool": call.name,
                    "command": command if isinstance(command, str) else json.dumps(args),
                    "exit_code": int(code.group(1)) if code else None,
                    "output": output,
                    "duration_s": None,
                    "turn": k,
                }
            )
    return cmds
