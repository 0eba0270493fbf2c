"""A verifiers.v1 taskset whose reward functions try to escape (miles-env's isolation test).

The framework's own code (its `@vf.reward` functions run in the worker, like its
tools) tries three things a sandboxed episode must not be able to do; each reward
is 1.0 when the attempt SUCCEEDED. What to try is read from `probe.json` next to
this file: `outside` (a host path to create, outside any workspace), `secret` (a
host file under $HOME to read), `port` (a TCP port listening on the host's loopback).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.task import Task, TaskData
from verifiers.v1.taskset import Taskset

PROBE = json.loads(Path(__file__).with_name("probe.json").read_text())


class ProbeTask(Task[TaskData]):
    @vf.reward
    async def wrote_outside(self, trace: Any) -> float:
        try:
            Path(PROBE["outside"]).write_text("escaped")
            return 1.0
        except OSError:
            return 0.0

    @vf.reward
    async def read_home(self, trace: Any) -> float:
        try:
            return 1.0 if Path(PROBE["secret"]).read_text() else 0.0
        except OSError:
            return 0.0

    @vf.reward
    async def reached_host(self, trace: Any) -> float:
        try:
            socket.create_connection(("127.0.0.1", int(PROBE["port"])), timeout=3).close()
            return 1.0
        except OSError:
            return 0.0


class ProbeTaskset(Taskset[ProbeTask]):
    def load(self) -> Iterator[ProbeTask]:
        yield ProbeTask(TaskData(id="probe", prompt="Say anything."), self.config.task)


__all__ = ["ProbeTaskset"]
