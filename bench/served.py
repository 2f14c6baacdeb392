"""What the benchmarks that start an HTTP server share: a free loopback port, and waiting for /healthz."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_healthy(
    client: httpx.Client,
    server: subprocess.Popen,
    log: Path,
    what: str,
    timeout_s: float = 120,
    interval_s: float = 0.2,
) -> None:
    """Until `GET /healthz` answers 200; exits with the server's log tail if it dies or never answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if client.get("/healthz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{what} did not come up:\n{log.read_text()[-4000:]}")
        time.sleep(interval_s)
