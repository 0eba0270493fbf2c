"""Isolation under load: one session's maximal request must not stall another session's turns.

The proxy runs here; two other processes are its clients, as in production: one sends a
session request bodies at the size limit (a prompt far over the context), back to back;
the other measures a second session's 1-token turns, first alone, then under that load.
The bound is relative, measured in the same test on the same (possibly busy) machine:
the loaded p99 within 2x the unloaded p99 plus 100 ms. Measured on a busy 2-core box:
unloaded p99 1-3 ms, loaded p50 ~3 ms, p99 20-35 ms: what is left is CPU and GIL sharing
with the thread parsing 16 MiB (its single C calls, e.g. json.loads, take a few ms each).
Before the fix each maximal body held the event loop for tens of seconds (tokenization),
every other session with it; even a 2 MiB body put the others' p99 at ~1.4 s.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from miles_env.models import load_tokenizer
from miles_env.tito import TitoConfig
from tests.tito_support import threaded

N_TURNS = 300

SENDER = r"""
import http.client, json, sys, time
host, port, path, key, size = sys.argv[1:6]
shell = json.dumps({"model": "policy", "messages": [{"role": "user", "content": ""}]}).encode()
filler = ("word " * (int(size) // 5 + 1))[: int(size) - len(shell)]
body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": filler}]}).encode()
assert len(body) == int(size)
conn = http.client.HTTPConnection(host, int(port), timeout=120)
print("ready", flush=True)
while True:
    t0 = time.perf_counter()
    conn.request("POST", path, body, {"x-api-key": key, "content-type": "application/json"})
    r = conn.getresponse()
    r.read()
    print(r.status, round(time.perf_counter() - t0, 4), flush=True)
"""

TURNS = r"""
import http.client, json, socket, sys, time
host, port, path, key, n = sys.argv[1:6]
body = json.dumps({"model": "policy", "max_tokens": 1, "messages": [{"role": "user", "content": "ping"}]})
conn = http.client.HTTPConnection(host, int(port), timeout=120)
conn.connect()
conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
out = []
for i in range(30 + int(n)):
    t0 = time.perf_counter()
    conn.request("POST", path, body, {"x-api-key": key, "content-type": "application/json"})
    r = conn.getresponse()
    r.read()
    assert r.status == 200, r.status
    if i >= 30:  # the first 30 warm up
        out.append(time.perf_counter() - t0)
print(json.dumps(out))
"""


def _p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _turns(host: str, port: str, sid: str, key: str) -> list[float]:
    path = f"/s/{sid}/v1/chat/completions"
    run = subprocess.run(
        [sys.executable, "-c", TURNS, host, port, path, key, str(N_TURNS)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr
    return list(json.loads(run.stdout))


def test_a_maximal_body_does_not_stall_other_sessions(tmp_path: Path) -> None:
    tok = load_tokenizer()
    limit = TitoConfig().max_body_bytes
    with threaded(tok, store_dir=tmp_path) as t:
        small, big = t.session(), t.session()
        host, port = t.url.removeprefix("http://").split(":")
        idle = _turns(host, port, small.session_id, small.api_key)
        args = [host, port, f"/s/{big.session_id}/v1/chat/completions", big.api_key, str(limit)]
        sender = subprocess.Popen([sys.executable, "-c", SENDER, *args], stdout=subprocess.PIPE, text=True)
        try:
            assert sender.stdout is not None and sender.stdout.readline().strip() == "ready"
            first = sender.stdout.readline().split()  # the first maximal body was answered: load is on
            loaded = _turns(host, port, small.session_id, small.api_key)
        finally:
            sender.kill()
            rest, _ = sender.communicate(timeout=60)
    answered = [first, *(line.split() for line in rest.splitlines() if line.strip())]
    assert {x[0] for x in answered} == {"400"}  # each refused (context), none a 5xx or a 413
    figures: dict[str, Any] = {
        "idle_p50_ms": round(_p(idle, 0.5) * 1e3, 2),
        "idle_p99_ms": round(_p(idle, 0.99) * 1e3, 2),
        "loaded_p50_ms": round(_p(loaded, 0.5) * 1e3, 2),
        "loaded_p99_ms": round(_p(loaded, 0.99) * 1e3, 2),
        "loaded_max_ms": round(max(loaded) * 1e3, 2),
        "maximal_bodies_answered": len(answered),
        "maximal_body_p50_s": round(_p([float(x[1]) for x in answered], 0.5), 3),
        "body_bytes": limit,
    }
    print("tito isolation:", json.dumps(figures))
    assert len(answered) >= 3, figures  # the load really overlapped the measured turns
    # a stalled loop costs seconds per turn; 250 ms of slack is a busy sibling worker's noise (seen with mypy)
    assert _p(loaded, 0.99) <= 2 * _p(idle, 0.99) + 0.250, figures
