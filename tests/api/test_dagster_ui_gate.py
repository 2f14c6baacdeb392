"""The Dagster UI is for operators only: no key, a team's key or another site's page gets nothing from the
webserver, whether served in-process (`make serve`) or behind the proxy (Kubernetes)."""

import base64
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from batch_pipeline.entrypoints.dagster_ui import OPERATOR_KEY_FILE, operator_key
from tests.api_fixtures import REPO, write_instance_config

ADMIN_KEY = "admin-key-of-the-operators"
TEAM_KEY = "team-a-key"
# What the launchpad's "Launch run" posts, trimmed: any mutation would do.
TERMINATE = {
    "query": "mutation($runId: String!) { terminateRun(runId: $runId) { __typename } }",
    "variables": {"runId": "0" * 36},
}


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _basic(key: str) -> dict[str, str]:
    return {"authorization": "Basic " + base64.b64encode(f"operator:{key}".encode()).decode()}


class Process:
    def __init__(self, command: list[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        self.process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_for(self, url: str, headers: dict[str, str] | None = None, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(url, headers=headers, timeout=5).status_code in (200, 401):
                    return
            except httpx.TransportError:
                pass
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.5)

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """One Dagster home with a tenants file (team-a, and an admin key), its webserver behind the gate
    in-process, and a plain read-only webserver behind the gate as a proxy, as k8s/dagster-ui.yaml runs it."""
    tmp = tmp_path_factory.mktemp("ui")
    home = tmp / "dagster_home"
    write_instance_config(home, max_concurrent_runs=1)
    tenants = tmp / "tenants.yaml"
    tenants.write_text(
        f"tenants:\n  team-a:\n    api_keys_sha256: [{_digest(TEAM_KEY)}]\n    data_roots: [{tmp / 'a'}]\n"
        f"admins:\n  api_keys_sha256: [{_digest(ADMIN_KEY)}]\n"
    )
    env = {**os.environ, "DAGSTER_HOME": str(home), "BATCH_PIPELINE_TENANTS": str(tenants)}
    workspace = str(REPO / "workspace.yaml")
    gate_port, upstream_port, proxy_port = _free_port(), _free_port(), _free_port()
    gate_command = [sys.executable, "-m", "batch_pipeline.entrypoints.dagster_ui", "-w", workspace]
    upstream_command = [str(Path(sys.executable).parent / "dagster-webserver"), "-w", workspace, "--read-only"]
    upstream_url = f"http://127.0.0.1:{upstream_port}"
    proxy_command = [sys.executable, "-m", "batch_pipeline.entrypoints.dagster_ui", "--upstream", upstream_url]
    started: list[Process] = []
    try:
        # One after another: two webservers creating a new instance's SQLite tables at once, one dies of it.
        for name, command, port in (
            ("gate", gate_command + ["--port", str(gate_port)], gate_port),
            ("upstream", upstream_command + ["-p", str(upstream_port)], upstream_port),
            ("proxy", proxy_command + ["--port", str(proxy_port)], proxy_port),
        ):
            started.append(Process(command, tmp / f"{name}.log", env))
            started[-1].wait_for(f"http://127.0.0.1:{port}/server_info")
        yield {
            "gate": f"http://127.0.0.1:{gate_port}",
            "proxy": f"http://127.0.0.1:{proxy_port}",
            "home": home,
            "tenants": tenants,
        }
    finally:
        for process in started:
            process.stop()


def _runs(url: str) -> list:
    query = {"query": "{ runsOrError { ... on Runs { results { runId } } } }"}
    response = httpx.post(f"{url}/graphql", json=query, headers=_basic(ADMIN_KEY), timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["data"]["runsOrError"]["results"]


@pytest.mark.slow
@pytest.mark.parametrize("front", ["gate", "proxy"])
def test_no_key_and_no_team_key_reach_the_dagster_ui(deployment, front):
    url = deployment[front]
    for headers in ({}, _basic(TEAM_KEY), _basic("not-a-key"), {"authorization": "Bearer " + ADMIN_KEY}):
        for method, path, body in (("GET", "/", None), ("GET", "/server_info", None), ("POST", "/graphql", TERMINATE)):
            response = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
            assert response.status_code == 401, (front, headers, path, response.text)
            assert response.headers["www-authenticate"].startswith("Basic realm=")
            assert "dagster" not in response.text.lower().replace("dagster ui", "")
    # An operator's admin key opens it, as the user name (Scale's SDK style) or as the password.
    for headers in (
        _basic(ADMIN_KEY),
        {"authorization": "Basic " + base64.b64encode(f"{ADMIN_KEY}:".encode()).decode()},
    ):
        response = httpx.get(f"{url}/server_info", headers=headers, timeout=30)
        assert response.status_code == 200 and response.json()["dagster_version"], response.text
    assert _runs(url) == []


@pytest.mark.slow
def test_the_local_operator_key_is_the_service_users_own_and_opens_the_ui(deployment):
    key_file = deployment["home"] / OPERATOR_KEY_FILE
    assert key_file.stat().st_mode & 0o777 == 0o600
    key = key_file.read_text().strip()
    assert len(key) >= 40 and operator_key(deployment["home"]) == key  # made once, kept
    assert httpx.get(f"{deployment['gate']}/server_info", headers=_basic(key), timeout=30).status_code == 200


def test_a_key_file_others_can_read_is_refused(tmp_path):
    operator_key(tmp_path)
    (tmp_path / OPERATOR_KEY_FILE).chmod(0o644)
    with pytest.raises(PermissionError, match="readable by other users"):
        operator_key(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("front", ["gate", "proxy"])
def test_another_sites_page_cannot_act_through_an_operators_browser(deployment, front):
    url = deployment[front]
    headers = {**_basic(ADMIN_KEY), "origin": "http://evil.example"}
    response = httpx.post(f"{url}/graphql", json=TERMINATE, headers=headers, timeout=30)
    assert response.status_code == 403, response.text
    # The same mutation from the UI's own page gets to the webserver (which answers it).
    host = url.removeprefix("http://")
    same_site = httpx.post(f"{url}/graphql", json=TERMINATE, headers={**_basic(ADMIN_KEY), "origin": url}, timeout=30)
    assert same_site.status_code == 200 and "terminateRun" in same_site.json()["data"], (host, same_site.text)


@pytest.mark.slow
@pytest.mark.parametrize("front", ["gate", "proxy"])
def test_a_cross_site_get_runs_no_graphql_but_a_link_to_a_page_opens_it(deployment, front):
    """A browser sends an operator's cached key with another site's requests too; Dagster runs a mutation
    sent as GET /graphql?query=... (an <img> would do), so no cross-site request reaches GraphQL."""
    url = deployment[front]
    mutation = {"query": "mutation { setAutoMaterializePaused(paused: true) }"}
    for fetch in (
        {"sec-fetch-site": "cross-site", "sec-fetch-mode": "no-cors", "accept": "image/*"},
        {"sec-fetch-site": "same-site", "sec-fetch-mode": "cors"},
        {"sec-fetch-site": "cross-site", "sec-fetch-mode": "navigate", "sec-fetch-dest": "document"},
        {},  # a browser that says nothing of where a request comes from (an <img> in an old one)
        {"sec-fetch-site": "same-origin", "sec-fetch-mode": "cors"},  # GraphQL takes no GET query at all
    ):
        response = httpx.get(f"{url}/graphql", params=mutation, headers={**_basic(ADMIN_KEY), **fetch}, timeout=30)
        assert response.status_code == 403, (fetch, response.text)
    # A form's POST (no preflight) with no Origin, as an old browser sends it: not JSON, refused.
    form = httpx.post(f"{url}/graphql", data=mutation, headers=_basic(ADMIN_KEY), timeout=30)
    assert form.status_code == 403, form.text
    followed = {"sec-fetch-site": "cross-site", "sec-fetch-mode": "navigate", "sec-fetch-dest": "document"}
    page = httpx.get(f"{url}/runs", headers={**_basic(ADMIN_KEY), **followed, "accept": "text/html"}, timeout=30)
    assert page.status_code == 200
    # ...but never in another site's frame, where a decoy button could launch a run: refused, and every
    # answer forbids framing.
    framed = {**followed, "sec-fetch-dest": "iframe"}
    assert httpx.get(f"{url}/runs", headers={**_basic(ADMIN_KEY), **framed}, timeout=30).status_code == 403
    assert page.headers["x-frame-options"] == "DENY"
    assert "frame-ancestors 'none'" in page.headers.get_list("content-security-policy")
    embedded = {"sec-fetch-site": "cross-site", "sec-fetch-mode": "no-cors"}
    assert httpx.get(f"{url}/server_info", headers={**_basic(ADMIN_KEY), **embedded}, timeout=30).status_code == 403
    # The UI's own requests (a JSON POST), and the operator's typed address, pass.
    for own in ({"sec-fetch-site": "same-origin", "sec-fetch-mode": "cors", "origin": url}, {"sec-fetch-site": "none"}):
        query = {"query": "{ version }"}
        answer = httpx.post(f"{url}/graphql", json=query, headers={**_basic(ADMIN_KEY), **own}, timeout=30)
        assert answer.json()["data"]["version"], answer.text


@pytest.mark.slow
def test_a_revoked_admin_key_and_a_deleted_operator_key_stop_at_once(deployment):
    url, tenants, key_file = deployment["gate"], deployment["tenants"], deployment["home"] / OPERATOR_KEY_FILE
    before, local = tenants.read_text(), key_file.read_text().strip()
    other_admin = "the-next-operators-key"
    try:
        tenants.write_text(before.replace(_digest(ADMIN_KEY), _digest(other_admin)))
        assert httpx.get(f"{url}/server_info", headers=_basic(ADMIN_KEY), timeout=30).status_code == 401
        assert httpx.get(f"{url}/server_info", headers=_basic(other_admin), timeout=30).status_code == 200
        key_file.unlink()  # how an operator rotates it: serve makes a new one when it starts
        assert httpx.get(f"{url}/server_info", headers=_basic(local), timeout=30).status_code == 401
    finally:
        tenants.write_text(before)
        key_file.write_text(local + "\n")
        key_file.chmod(0o600)
    assert httpx.get(f"{url}/server_info", headers=_basic(local), timeout=30).status_code == 200


def _subscribe(url: str, headers: dict[str, str]) -> dict:
    """The UI's live updates: a graphql-ws connection, as the browser opens it."""
    with connect(
        url.replace("http://", "ws://") + "/graphql",
        subprotocols=["graphql-ws"],
        additional_headers=headers,
        open_timeout=30,
    ) as socket_:
        socket_.send(json.dumps({"type": "connection_init", "payload": {}}))
        return json.loads(socket_.recv(timeout=30))


@pytest.mark.slow
@pytest.mark.parametrize("front", ["gate", "proxy"])
def test_the_uis_websocket_takes_an_operator_from_its_own_page_only(deployment, front):
    url = deployment[front]
    assert _subscribe(url, {**_basic(ADMIN_KEY), "origin": url}) == {"type": "connection_ack"}
    for headers in (
        {"origin": url},
        {**_basic(TEAM_KEY), "origin": url},
        {**_basic(ADMIN_KEY), "origin": "http://evil.example"},
    ):
        with pytest.raises(InvalidStatus) as refused:
            _subscribe(url, headers)
        assert refused.value.response.status_code == 403


@pytest.mark.slow
def test_the_sign_in_url_sends_the_browser_on_to_a_page_of_this_host_only(deployment):
    url = deployment["gate"]
    for target, expected in (
        ("/runs", url + "/runs"),
        ("//evil.example/x", url + "/"),
        ("http://evil.example", url + "/"),
        ("/x\r\nSet-Cookie: a=1", url + "/"),  # no header split
        ("/\t/evil.example", url + "/"),  # a browser strips the tab
    ):
        response = httpx.get(
            f"{url}/_operators/sign-in", params={"next": target}, headers=_basic(ADMIN_KEY), timeout=30
        )
        assert response.status_code == 303 and response.headers["location"] == expected, (target, response.headers)
