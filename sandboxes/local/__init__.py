"""The embedded local sandbox provider ("local"): bubblewrap, no network unless the spec asks for
`public` (slirp4netns: outbound only, never the host's loopback), resource limits.

Use: `async with await LocalSandboxProvider().create(spec) as sb: await sb.exec("echo hi")`.
"""

from __future__ import annotations

from .config import LocalSandboxConfig, find_bwrap
from .provider import LocalSandboxProvider
from .sandbox import LocalSandbox

__all__ = ["LocalSandboxConfig", "LocalSandboxProvider", "LocalSandbox", "find_bwrap"]
