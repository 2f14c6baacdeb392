"""`make serve`: the API, the Dagster webserver and the daemon come up together and stop together."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from tests.api_fixtures import REPO, write_instance_config


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_ok(url: str, log, timeout: float = 120) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        try:
            response = httpx.get(url, timeout=5)
            if response.status_code == 200:
                return response
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{url} did not come up; serve log:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)


def _descendants(root: int) -> list[int]:
    table = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True, check=True).stdout
    children: dict[int, list[int]] = {}
    for line in table.splitlines():
        pid, ppid = map(int, line.split())
        children.setdefault(ppid, []).append(pid)
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            return "zombie" not in status.read().lower()
    except FileNotFoundError:
        return False


def test_serve_starts_api_webserver_and_daemon_and_ctrl_c_stops_them_all(tmp_path):
    home = tmp_path / "dagster_home"
    write_instance_config(home, max_concurrent_runs=1)
    api_port, dagster_port = _free_port(), _free_port()
    serve = subprocess.Popen(
        [sys.executable, "-m", "batch_pipeline.serve", "--port", str(api_port), "--dagster-port", str(dagster_port)],
        cwd=REPO,
        env={**os.environ, "DAGSTER_HOME": str(home)},
        # A file, not a pipe: nobody reads a pipe here, and the services would block once it filled.
        stdout=open(tmp_path / "serve.log", "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        assert _wait_ok(f"http://127.0.0.1:{api_port}/healthz", tmp_path / "serve.log").json() == {"status": "ok"}
        assert _wait_ok(f"http://127.0.0.1:{dagster_port}/server_info", tmp_path / "serve.log").json()["dagster_version"]
        started = _descendants(serve.pid)
        assert len(started) >= 3  # uvicorn, the webserver, the daemon, and what they started
        os.killpg(serve.pid, signal.SIGINT)  # what Ctrl-C sends
        assert serve.wait(timeout=60) == 0
        time.sleep(1)
        assert [pid for pid in started if _alive(pid)] == []
    finally:
        for pid in _descendants(serve.pid) + [serve.pid]:  # a failed test leaves nothing running
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
