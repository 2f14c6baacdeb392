"""`make serve`: the API, the Dagster webserver and the daemon come up together and stop together."""

import base64
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from batch_pipeline.entrypoints.dagster_ui import OPERATOR_KEY_FILE
from tests.api_fixtures import REPO, write_instance_config
from tests.conftest import MODEL


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_ok(url: str, log, timeout: float = 120, auth: tuple[str, str] | None = None) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        try:
            response = httpx.get(url, timeout=5, auth=auth)
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


def _listening_addresses(port: int) -> set[str]:
    """The IPv4 and IPv6 addresses a socket listens on at `port` on this machine (/proc/net/tcp*)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in rows.readlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                address, _, hex_port = local.partition(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    raw = bytes.fromhex(address)
                    words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]  # little-endian 32-bit words
                    found.add(socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, b"".join(words)))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            return "zombie" not in status.read().lower()
    except FileNotFoundError:
        return False


class Served:
    """`python -m batch_pipeline.entrypoints.serve` (what `make serve` runs) on free ports in a fresh DAGSTER_HOME."""

    def __init__(
        self,
        tmp_path,
        env: dict[str, str] | None = None,
        max_concurrent_runs: int = 1,
        instance_yaml: str | None = None,
        workspace=None,
    ) -> None:
        self.home = home = tmp_path / "dagster_home"
        write_instance_config(home, max_concurrent_runs=max_concurrent_runs)
        if instance_yaml is not None:  # e.g. the shipped dagster.yaml, adjusted
            (home / "dagster.yaml").write_text(instance_yaml)
        self.log = tmp_path / "serve.log"
        self.api_port, self.dagster_port = _free_port(), _free_port()
        self.api = f"http://127.0.0.1:{self.api_port}"
        self.ui = f"http://127.0.0.1:{self.dagster_port}"
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "batch_pipeline.entrypoints.serve",
                "--host",  # the API on every address; the Dagster UI must keep to loopback all the same
                "0.0.0.0",
                "--port",
                str(self.api_port),
                "--dagster-port",
                str(self.dagster_port),
                *(["--workspace", str(workspace)] if workspace is not None else []),
            ],
            cwd=REPO,
            env={**os.environ, "DAGSTER_HOME": str(home), "BATCH_PIPELINE_SENSOR_INTERVAL_S": "1", **(env or {})},
            # A file, not a pipe: nobody reads a pipe here, and the services would block once it filled.
            stdout=open(self.log, "wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def operator_auth(self) -> tuple[str, str]:
        """Basic auth with the operator key `serve` made in DAGSTER_HOME (the UI's password)."""
        return ("operator", (self.home / OPERATOR_KEY_FILE).read_text().strip())

    def wait_until_up(self) -> None:
        assert _wait_ok(f"{self.api}/healthz", self.log).json() == {"status": "ok"}
        assert _wait_ok(f"{self.ui}/server_info", self.log, auth=self.operator_auth).json()["dagster_version"]

    def kill(self) -> None:
        for pid in _descendants(self.process.pid) + [self.process.pid]:  # a failed test leaves nothing running
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def served(tmp_path):
    server = Served(tmp_path)
    yield server
    server.kill()


@pytest.mark.slow
def test_serve_starts_api_webserver_and_daemon_and_ctrl_c_stops_them_all(served):
    served.wait_until_up()
    started = _descendants(served.process.pid)
    assert len(started) >= 3  # uvicorn, the webserver, the daemon, and what they started
    os.killpg(served.process.pid, signal.SIGINT)  # what Ctrl-C sends
    assert served.process.wait(timeout=60) == 0
    time.sleep(1)
    assert [pid for pid in started if _alive(pid)] == []


def _chromium(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    assert binary, "chromium is not installed (.ci/run installs Debian's chromium)"
    return subprocess.run(
        [
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            "--window-size=1440,900",
            "--virtual-time-budget=20000",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.slow
def test_the_dagster_ui_shows_a_finished_job_and_a_launchpad_run_is_a_job_of_the_api(served, tmp_path):
    from dagster_graphql import DagsterGraphQLClient, DagsterGraphQLClientError
    from requests.auth import HTTPBasicAuth

    served.wait_until_up()
    # `--host 0.0.0.0` moved the API; the UI stays on loopback, and shows or does nothing without an
    # operator key: not its pages, not GraphQL (the launchpad's mutations), not its version.
    assert _listening_addresses(served.api_port) == {"0.0.0.0"}
    assert _listening_addresses(served.dagster_port) == {"127.0.0.1"}
    for path in ("/", "/server_info", "/graphql"):
        assert httpx.get(f"{served.ui}{path}", timeout=30).status_code == 401
    assert httpx.post(f"{served.ui}/graphql", json={"query": "{version}"}, timeout=30).status_code == 401
    (served.home / ".nux").mkdir()  # the community sign-up modal was dismissed once ("Skip"), as users do
    (served.home / ".nux" / "nux.yaml").write_text("seen: 1\n")
    content = {"prompts": ["The capital of France is", "Water boils at"], "max_new_tokens": 6, "temperature": 0.0}
    body = {
        "output_data_path": str(tmp_path / "api.json"),
        "model_config": {"model": MODEL},
        "content": content,
        "labels": {"team": "ui"},
    }
    job_id = httpx.post(f"{served.api}/v2/batch-completions", json=body, timeout=30).json()["job_id"]
    # What the launchpad's "Launch run" sends: the webserver's GraphQL mutation with the request as config.
    graphql = DagsterGraphQLClient(
        "127.0.0.1", port_number=served.dagster_port, auth=HTTPBasicAuth(*served.operator_auth)
    )
    # A launch that reconfigures a resource (the worker's environment: a shell as the service's user) is
    # refused before any run is made, naming the field.
    with pytest.raises(
        DagsterGraphQLClientError, match=r'(?s)RunConfigValidationInvalid.*unexpected config entry "env"'
    ):
        graphql.submit_job_execution(
            "batch_completions",
            run_config={
                "ops": {"validate_input": {"config": {**body, "output_data_path": str(tmp_path / "evil.json")}}},
                "resources": {"shard_launcher": {"config": {"env": {"PYTHONSTARTUP": str(tmp_path / "evil.py")}}}},
            },
        )
    launchpad_run = graphql.submit_job_execution(
        "batch_completions",
        run_config={"ops": {"validate_input": {"config": {**body, "output_data_path": str(tmp_path / "ui.json")}}}},
    )

    deadline = time.monotonic() + 400
    while True:
        jobs = {
            job["job_id"]: job for job in httpx.get(f"{served.api}/v2/batch-completions", timeout=30).json()["jobs"]
        }
        by_run = {job["metadata"].get("dagster_run_id"): job for job in jobs.values()}
        if (
            jobs.get(job_id, {}).get("status") == "completed"
            and by_run.get(launchpad_run, {}).get("status") == "completed"
        ):
            break
        assert time.monotonic() < deadline, f"jobs did not complete: {jobs}\n{served.log.read_text()[-3000:]}"
        time.sleep(1)
    run_id = jobs[job_id]["metadata"]["dagster_run_id"]
    assert by_run[launchpad_run]["output_data_path"] == str(tmp_path / "ui.json")
    # The console says what happened, not each sensor's every idle tick (the UI keeps those).
    console = served.log.read_text()
    assert "skipped: " not in console and "Checking for new runs for sensor" not in console, console[-3000:]

    # The run's page, rendered by a real browser: the job, its status, its tags and its steps.
    # Signed in as an operator would be: the key in the sign-in URL, the run page served without it.
    user, key = served.operator_auth
    run_page = f"http://{user}:{key}@127.0.0.1:{served.dagster_port}/_operators/sign-in?next=/runs/{run_id}"
    refused = _chromium("--dump-dom", f"{served.ui}/runs/{run_id}").stdout
    assert job_id not in refused and "batch_completions" not in refused  # the browser shows nothing of it
    dom = _chromium("--dump-dom", run_page).stdout
    text = re.sub(r"<[^>]+>", " ", re.sub(r"<(style|script)[^>]*>.*?</\1>", " ", dom, flags=re.S))
    text = re.sub(r"\s+", " ", text)
    for expected in (
        "batch_completions",
        "Success",
        job_id,
        "batch_completions / outputs",
        "run_shard[shard_000]",
        "write_job_metadata",
    ):
        assert expected in text, f"{expected!r} is not on the run page: {text}"
    screenshot = tmp_path / "run.png"
    _chromium(f"--screenshot={screenshot}", run_page)
    from PIL import Image

    with Image.open(screenshot) as image:
        assert image.size == (1440, 900)
        colors = image.convert("L").getcolors(maxcolors=1 << 16)
        assert colors is None or len(colors) > 50  # a rendered page, not a blank one
    if os.environ.get("BATCH_PIPELINE_SCREENSHOT"):  # how docs/dagster-ui-run.png is made
        shutil.copy(screenshot, os.environ["BATCH_PIPELINE_SCREENSHOT"])


@pytest.mark.slow  # starts `serve` itself, a process per case
@pytest.mark.parametrize("taken", ["api", "ui"])
def test_a_taken_port_is_one_line_naming_the_option_and_a_failing_exit(tmp_path, taken):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy, free = holder.getsockname()[1], _free_port()
        api_port, ui_port = (busy, free) if taken == "api" else (free, busy)
        completed = subprocess.run(
            [sys.executable, "-m", "batch_pipeline.entrypoints.serve", "--port", str(api_port)]
            + ["--dagster-port", str(ui_port)],
            cwd=REPO,
            env={**os.environ, "DAGSTER_HOME": str(tmp_path / "home")},
            capture_output=True,
            text=True,
            timeout=120,
        )
    option = "--port" if taken == "api" else "--dagster-port"
    assert completed.returncode != 0
    assert f"port {busy} on 127.0.0.1 is taken: pass {option} with a free port" in completed.stderr
    assert "Traceback" not in completed.stderr, completed.stderr
    assert not (tmp_path / "home").exists()  # refused before anything started


def _environment(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as handle:
        pairs = [item.split(b"=", 1) for item in handle.read().split(b"\0") if b"=" in item]
    return {name.decode(): value.decode(errors="replace") for name, value in pairs}


def _command_line(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as handle:
        return handle.read().replace(b"\0", b" ").decode(errors="replace")


@pytest.mark.slow
def test_each_service_serve_starts_holds_only_its_own_secrets(tmp_path):
    """The webhook secrets reach the webhook process alone, the API's keys the API alone: the Dagster
    processes (webserver, daemon, code servers, and what they start) hold neither."""
    secret = "whsec_" + base64.b64encode(b"team-a's secret, 24 bytes").decode()
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(
        "tenants:\n  team-a:\n    api_keys_sha256: [" + hashlib.sha256(b"team-a-key").hexdigest() + "]\n"
        f"    data_roots: [{tmp_path / 'a'}]\n"
        "    webhooks: [{url: 'https://hooks.example/a', secret_env: TEAM_A_WEBHOOK_SECRET}]\n"
    )
    env = {
        "BATCH_PIPELINE_TENANTS": str(tenants),
        "TEAM_A_WEBHOOK_SECRET": secret,
        "BATCH_PIPELINE_API_KEYS": "a-key-of-the-api",
    }
    served = Served(tmp_path, env=env)
    try:
        served.wait_until_up()
        time.sleep(2)  # the daemon's code server is up by now too
        holders: dict[str, set[str]] = {}
        for pid in _descendants(served.process.pid):
            try:
                environment, command = _environment(pid), _command_line(pid)
            except (FileNotFoundError, ProcessLookupError):
                continue
            for name in ("TEAM_A_WEBHOOK_SECRET", "BATCH_PIPELINE_API_KEYS"):
                if name in environment:
                    holders.setdefault(name, set()).add(command)
        assert holders["TEAM_A_WEBHOOK_SECRET"] and all(
            "batch_pipeline.webhooks" in command for command in holders["TEAM_A_WEBHOOK_SECRET"]
        ), holders
        assert holders["BATCH_PIPELINE_API_KEYS"] and all(
            "batch_pipeline.api.app" in command for command in holders["BATCH_PIPELINE_API_KEYS"]
        ), holders
    finally:
        served.kill()
