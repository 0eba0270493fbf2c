"""Why a Harbor build, setup or test step failed, when the cause is a network it does not have.

Concept: offline, the first error a step prints often points elsewhere: `curl ... | sh` exits 0
(curl fails, `sh` runs an empty script), so the next line is blamed (`uvx: command not found`);
pip against a distribution's Python stops at PEP 668 before it would have failed to reach the
index. `hint(output, script)` names the real need in one line, or returns None.

Invariant: pure; a hint only adds to the output it explains, it never replaces it.
"""

from __future__ import annotations

import re

__all__ = ["hint"]

_RULES: tuple[tuple[str, str], ...] = (
    (r"(uvx?|uv): (command )?not found",
     "uv is missing: astral's installer (`curl ... astral.sh/uv/... | sh`) downloaded nothing (its "
     "host is not reachable from here) and `sh` ran an empty script, exiting 0"),
    (r"externally-managed-environment",
     "pip refused the system Python (PEP 668) before reaching any index: install the package in "
     "the Dockerfile (the image build has a package index), or use a venv"),
    (r"No interpreter found for Python ([\d.]+)|download of Python .* is disabled",
     "uv needs a Python the image does not have, and uv may not download one here "
     "(UV_PYTHON_DOWNLOADS=never; no Debian suite ships every 3.x)"),
    (r"Could not find a version that satisfies|No matching distribution found|"
     r"Failed to establish a new connection|Network is unreachable|Temporary failure in name resolution",
     "pip needs a package index, which this sandbox cannot reach (no network); provision it at build time"),
    (r"Unable to locate package|Temporary failure resolving|Could not resolve '",
     "apt-get needs the Debian archive, which this sandbox cannot reach (no network); install it in "
     "the Dockerfile"),
    (r"Failed to fetch: .*(pypi|files\.pythonhosted)|error: Failed to (fetch|download)",
     "uv needs a package index, which this sandbox cannot reach (no network); provision it at build time"),
    (r"curl: \(6\) Could not resolve host: (\S+)",
     "curl could not reach {0}: this sandbox (or build) reaches only the package registries"),
)  # fmt: skip


# A pytest run's closing line: the tests ran, so what failed is in them, not in a download before.
_RAN = re.compile(r"^=+ .*\b(passed|failed|errors?|no tests ran)\b.* in [\d.]+s.* =+$", re.M)


def hint(output: str, script: str = "") -> str | None:
    """One line naming the network need behind `output`'s failure, or None. Only what was printed
    after the tests' own summary counts (a harmless offline `curl ... | sh` before tests that then
    ran and failed is not the reason; with hermetic verification it is the expected no-op)."""
    ran = list(_RAN.finditer(output))
    if ran:
        output = output[ran[-1].end() :]
    for pattern, text in _RULES:
        m = re.search(pattern, output)
        if m is None:
            continue
        if text.startswith("uv is missing") and "astral.sh" not in script + output:
            return "uv is not installed in this image"
        return text.format(*(g for g in m.groups() if g)) if "{0}" in text else text
    return None
