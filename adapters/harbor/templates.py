"""Harbor's `${VAR}` / `${VAR:-default}` values in task.toml's env tables, from the host's environment.

Invariant: a required variable that is unset is a TaskError naming the table and the key.
"""

from __future__ import annotations

import os
import re

from miles_env.errors import TaskError

__all__ = ["resolve_env"]

_TEMPLATE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?\}")


def resolve_env(values: dict[str, str], where: str) -> dict[str, str]:
    """Harbor's `${VAR}` / `${VAR:-default}` templates, from the host environment."""
    out = {}
    for key, value in values.items():
        m = _TEMPLATE.fullmatch(value)
        if m is None:
            out[key] = value
        elif m.group(1) in os.environ:
            out[key] = os.environ[m.group(1)]
        elif m.group(2) is not None:
            out[key] = m.group(2)
        else:
            raise TaskError(f"{where}.{key}: ${{{m.group(1)}}} is not set in the environment")
    return out
