"""What the benchmarks that start an HTTP server share: a free loopback port, waiting for /healthz, and the
whole deployment (`serve`) started and stopped."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
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
    path: str = "/healthz",
) -> None:
    """Until `GET {path}` answers 200; exits with the server's log tail if it dies or never answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if client.get(path).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{what} did not come up:\n{log.read_text()[-4000:]}")
        time.sleep(interval_s)


def start_serve(home: Path, env: dict[str, str], repo: Path) -> tuple[subprocess.Popen, httpx.Client]:
    """`python -m batch_pipeline.entrypoints.serve` (API, Dagster webserver, daemon) on free loopback ports in
    `home` (its DAGSTER_HOME, holding the dagster.yaml to use), with `env` as its whole environment, its log in
    home/serve.log; returns once the API, the webserver and the daemon's sensor and run-queue loops are up, so
    that what is timed after includes none of their start. Stop it with `stop_serve`."""
    api_port, dagster_port = free_port(), free_port()
    # The benchmarks measure generation, round after round on one deployment: the result cache would answer
    # the later rounds. result_cache.py, which measures the cache, passes BATCH_PIPELINE_RESULT_CACHE=1.
    env = {"BATCH_PIPELINE_RESULT_CACHE": "0", **env}
    log = home / "serve.log"
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "batch_pipeline.entrypoints.serve",
            "--port",
            str(api_port),
            "--dagster-port",
            str(dagster_port),
        ],
        cwd=repo,
        env={**env, "DAGSTER_HOME": str(home)},
        stdout=open(log, "wb"),  # a file, not a pipe nobody reads
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{api_port}", timeout=120)
    try:
        wait_until_healthy(client, serve, log, "the deployment", interval_s=0.5)
        # The UI asks for an operator key: the one serve made before it started its services.
        operator = ("operator", (home / "operator.key").read_text().strip())
        with httpx.Client(base_url=f"http://127.0.0.1:{dagster_port}", timeout=30, auth=operator) as ui:
            wait_until_healthy(ui, serve, log, "the Dagster webserver", interval_s=0.5, path="/server_info")
        _wait_for_daemon(home, serve, log)
    except BaseException:
        client.close()
        stop_serve(serve)
        raise
    return serve, client


def _wait_for_daemon(home: Path, server: subprocess.Popen, log: Path, timeout_s: float = 180) -> None:
    """Until the daemon's sensor and run-queue loops have each written a heartbeat to the instance."""
    import dagster as dg

    instance = dg.DagsterInstance.from_config(str(home))
    try:
        deadline = time.monotonic() + timeout_s
        while not {"SENSOR", "QUEUED_RUN_COORDINATOR"} <= set(instance.get_daemon_heartbeats()):
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the Dagster daemon did not come up:\n{log.read_text()[-4000:]}")
            time.sleep(0.5)
    finally:
        instance.dispose()


def stop_serve(serve: subprocess.Popen) -> None:
    """Ctrl-C to the deployment's process group (what `make serve` stops on), then SIGKILL after 60 s."""
    try:
        os.killpg(serve.pid, signal.SIGINT)
        serve.wait(timeout=60)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(serve.pid, signal.SIGKILL)
        serve.wait()
