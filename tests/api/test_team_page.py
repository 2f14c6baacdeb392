"""The team page (`/team`): a team watches its own jobs in a browser with its key, and never another team's;
through the real app over HTTP, and once in a real headless Chromium."""

import base64
import hashlib
import hmac
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from batch_pipeline.store.progress import ShardProgressStore
from batch_pipeline.store.results import JobResults
from tests.api_fixtures import ADMIN_KEY as ADMIN_KEY_OF_KEYS
from tests.api_fixtures import OTHER_KEY, USER_KEY
from tests.conftest import MODEL

TEAM_A_KEY, TEAM_B_KEY, ADMIN_KEY = "acme-team-key", "bravo-team-key", "root-admin-key"
HOSTILE_LABEL = '<script>alert("owned")</script>'


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _write_tenants(path: Path, roots: dict[str, Path], team_a_keys: tuple[str, ...] = (TEAM_A_KEY,)) -> None:
    path.write_text(
        "tenants:\n"
        "  team-a:\n"
        f"    api_keys_sha256: [{', '.join(_digest(key) for key in team_a_keys)}]\n"
        f'    data_roots: ["{roots["a"]}"]\n'
        "    max_queued_jobs: 5\n"
        "    max_tokens_per_day: 100000\n"
        "  team-b:\n"
        f"    api_keys_sha256: [{_digest(TEAM_B_KEY)}]\n"
        f'    data_roots: ["{roots["b"]}"]\n'
        "admins:\n"
        f"  api_keys_sha256: [{_digest(ADMIN_KEY)}]\n"
    )


@pytest.fixture
def teams(tmp_path, monkeypatch):
    roots = {"a": tmp_path / "srv" / "team-a", "b": tmp_path / "srv" / "team-b"}
    for root in roots.values():
        root.mkdir(parents=True)
    _write_tenants(tmp_path / "tenants.yaml", roots)
    monkeypatch.setenv("BATCH_PIPELINE_TENANTS", str(tmp_path / "tenants.yaml"))
    return roots


@pytest.fixture
def api(teams, tenants_api):
    return tenants_api


def _submit(api, key: str, output: Path, labels: dict[str, str] | None = None) -> str:
    body = {
        "output_data_path": str(output),
        "model_config": {"model": MODEL},
        "content": {"prompts": ["The capital of France is", "Water boils at"], "max_new_tokens": 4, "temperature": 0},
        "labels": labels or {},
    }
    response = api.post("/v2/batch-completions", json=body, headers={"x-api-key": key})
    assert response.status_code == 200, response.text
    return response.json()["job_id"]


def _log_in(api, key: str) -> httpx.Response:
    """What a browser does: open the login form (its CSRF cookie and field), then post the key with it."""
    form = api.get("/team/login")
    assert form.status_code == 200
    csrf = re.search(r'name="csrf" value="([^"]+)"', form.text).group(1)
    return api.post("/team/login", data={"key": key, "csrf": csrf}, follow_redirects=False)


def _set_session(api, value: str) -> None:
    api.cookies.clear()
    api.cookies.set("batch_pipeline_team_session", value, path="/team")


def _completed_with_output(api, job_id: str, output: Path) -> None:
    """The job's run ended and wrote its output: what the pipeline records in the job's row, and the file
    merge_outputs writes (one result and one error entry)."""
    store = api.app.state.job_service.store
    store.link_run(job_id, "run-of-" + job_id)
    assert store.mark_started(job_id, "run-of-" + job_id)
    output.write_text(
        json.dumps(
            [
                {"text": " Paris.", "num_prompt_tokens": 6, "num_completion_tokens": 3},
                {"error": {"message": "prompts: past the context", "param": "prompts", "code": "prompt_too_long"}},
            ]
        )
    )
    store.mark_run_ended(job_id, "run-of-" + job_id, "completed", datetime.now(UTC))
    ShardProgressStore(engine=store.engine).record_results(
        job_id, "run-of-" + job_id, JobResults(num_requests=2, num_errors=1, requests_done=2)
    )


def test_a_running_jobs_phase_shows_on_the_team_page_while_its_engine_starts(api, teams):
    """Issue 46: `running`, 0 done, for the ~55 s an engine takes to start, said nothing of why."""
    running = _submit(api, TEAM_A_KEY, teams["a"] / "out.json")
    store = api.app.state.job_service.store
    assert store.mark_started(running, "run-of-" + running)
    progress = ShardProgressStore(engine=store.engine)
    progress.record_shards(running, {0: 4})
    progress.record_shard_charge(running, 0, 1.0)
    progress.record_shard_progress(running, 0, {"engine_starting": 1})  # as its worker reports it

    assert _log_in(api, TEAM_A_KEY).status_code == 303
    phase = re.compile(r'<span class="phase" data-field="phase">([^<]*)</span>')
    assert phase.findall(api.get("/team").text) == ["starting engine"]
    assert phase.findall(api.get(f"/team/jobs/{running}").text) == ["starting engine"]
    progress.record_shard_progress(running, 0, {"requests_done": 1})
    assert api.get(f"/team/jobs/{running}/status").json()["job"]["metadata"]["phase"] == "generating 1/4"


def test_a_teams_page_lists_its_jobs_and_never_another_teams(api, teams):
    mine = _submit(api, TEAM_A_KEY, teams["a"] / "out.json", {"project": "apollo"})
    theirs = _submit(api, TEAM_B_KEY, teams["b"] / "out.json", {"project": "bravo-secret"})

    assert _log_in(api, TEAM_A_KEY).status_code == 303
    page = api.get("/team")
    assert page.status_code == 200
    assert mine in page.text and "apollo" in page.text
    assert theirs not in page.text and "bravo-secret" not in page.text
    assert "team team-a" in page.text
    # Its job's own page and status; the other team's job is absent, as on the API.
    assert api.get(f"/team/jobs/{mine}").status_code == 200
    assert api.get(f"/team/jobs/{mine}/status").json()["job"]["status"] == "queued"
    for path in (f"/team/jobs/{theirs}", f"/team/jobs/{theirs}/status", f"/team/jobs/{theirs}/output"):
        response = api.get(path)
        assert response.status_code == 404, path
        assert "bravo-secret" not in response.text
    # Paging past the other team's job shows nothing of it either.
    assert theirs not in api.get("/team", params={"after": theirs}).text

    # An admin's session sees both teams' jobs, each with its team.
    api.cookies.clear()
    assert _log_in(api, ADMIN_KEY).status_code == 303
    page = api.get("/team")
    assert mine in page.text and theirs in page.text
    assert "<td>team-a</td>" in page.text and "<td>team-b</td>" in page.text


def test_without_a_tenants_file_each_key_logs_in_to_its_own_jobs(deployment_factory, tmp_path):
    # BATCH_PIPELINE_API_KEYS' keys: each key owns its jobs, as on the API.
    client = deployment_factory().client
    mine = _submit(client, USER_KEY, tmp_path / "mine.json")
    theirs = _submit(client, OTHER_KEY, tmp_path / "theirs.json")
    assert _log_in(client, USER_KEY).status_code == 303
    page = client.get("/team").text
    assert mine in page and theirs not in page
    assert client.get(f"/team/jobs/{theirs}").status_code == 404
    page = client.get("/team", headers={"x-api-key": ADMIN_KEY_OF_KEYS}).text
    assert mine in page and theirs in page


def test_usage_and_quotas_are_the_teams_own(api, teams):
    _submit(api, TEAM_A_KEY, teams["a"] / "out.json")
    _submit(api, TEAM_B_KEY, teams["b"] / "out.json")
    _log_in(api, TEAM_A_KEY)
    page = api.get("/team").text
    usage = api.get("/v2/usage", headers={"x-api-key": TEAM_A_KEY}).json()
    assert [team["team"] for team in usage["teams"]] == ["team-a"]
    # The figures /v2/usage answers: one job submitted today, and the queue against max_queued_jobs.
    assert re.search(r"<tr><td>team-a</td><td class=\"num\">1</td>", page)
    assert "1 / 5" in page and "0 / 100000" in page
    assert "team-b" not in page


def test_a_teams_output_downloads_through_the_page_and_another_teams_is_404(api, teams):
    mine = _submit(api, TEAM_A_KEY, teams["a"] / "out.json")
    theirs = _submit(api, TEAM_B_KEY, teams["b"] / "out.json")
    _completed_with_output(api, mine, teams["a"] / "out.json")
    _completed_with_output(api, theirs, teams["b"] / "out.json")

    _log_in(api, TEAM_A_KEY)
    download = api.get(f"/team/jobs/{mine}/output")
    assert download.status_code == 200
    assert download.content == (teams["a"] / "out.json").read_bytes()
    assert download.headers["content-disposition"] == f'attachment; filename="{mine}.json"'
    page = api.get(f"/team/jobs/{mine}").text
    assert f'href="/team/jobs/{mine}/output"' in page
    assert "prompt_too_long" in page and "prompts: past the context" in page  # its error entry, by index
    # Team B's finished output is not A's to read, by its page or by its key.
    refused = api.get(f"/team/jobs/{theirs}/output")
    assert refused.status_code == 404 and "Paris" not in refused.text
    assert api.get(f"/team/jobs/{theirs}/output", headers={"x-api-key": TEAM_A_KEY}).status_code == 404
    # B's own key downloads it (the API's own key, as scripts send it, works as a session does).
    assert api.get(f"/team/jobs/{theirs}/output", headers={"x-api-key": TEAM_B_KEY}).status_code == 200


def test_an_output_path_swapped_for_a_symlink_into_another_teams_root_is_not_served(api, teams):
    (teams["a"] / "outputs").mkdir()
    mine = _submit(api, TEAM_A_KEY, teams["a"] / "outputs" / "out.json")
    _completed_with_output(api, mine, teams["a"] / "outputs" / "out.json")
    # The job's output directory swapped, after its run, for a link into team B's root.
    (teams["a"] / "outputs").rename(teams["a"] / "kept")
    (teams["a"] / "outputs").symlink_to(teams["b"])
    (teams["b"] / "out.json").write_text('["team b\'s secret"]')
    _log_in(api, TEAM_A_KEY)
    response = api.get(f"/team/jobs/{mine}/output")
    assert response.status_code == 404 and "secret" not in response.text
    assert "secret" not in api.get(f"/team/jobs/{mine}").text


def test_without_a_session_the_page_sends_the_login(api, teams):
    mine = _submit(api, TEAM_A_KEY, teams["a"] / "out.json")
    response = api.get("/team", follow_redirects=False)
    assert response.status_code == 303 and response.headers["location"] == "/team/login"
    assert api.get(f"/team/jobs/{mine}", follow_redirects=False).headers["location"] == "/team/login"
    for path in (f"/team/jobs/{mine}/status", f"/team/jobs/{mine}/output"):
        refused = api.get(path)
        assert refused.status_code == 401 and "www-authenticate" not in refused.headers
    # A wrong key is refused, naming the field; a forged or tampered session is no session.
    form = api.get("/team/login")
    csrf = re.search(r'name="csrf" value="([^"]+)"', form.text).group(1)
    wrong = api.post("/team/login", data={"key": "guess", "csrf": csrf}, follow_redirects=False)
    assert wrong.status_code == 401 and "key: not a valid API key" in wrong.text
    for forged in (f"{int(time.time()) + 600}.nonce.{'A' * 43}", "garbage", ""):
        _set_session(api, forged)
        assert api.get("/team", follow_redirects=False).status_code == 303
    api.cookies.clear()


def test_the_session_cookie_holds_no_key_is_httponly_strict_and_ends_with_its_key(api, teams, tmp_path):
    mine = _submit(api, TEAM_A_KEY, teams["a"] / "out.json")
    login = _log_in(api, TEAM_A_KEY)
    cookie = next(value for value in login.headers.get_list("set-cookie") if value.startswith("batch_pipeline_team_s"))
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/team" in cookie and "Max-Age=28800" in cookie
    assert TEAM_A_KEY not in cookie and _digest(TEAM_A_KEY) not in cookie
    assert mine in api.get("/team").text
    # The API's routes never take the page's session: a cross-site form cannot act on the API through it.
    assert api.post(f"/v2/batch-completions/{mine}/actions/cancel").status_code == 401
    # A session made to last longer than its 8 hours is no session, whatever its mac.
    session = api.cookies.get("batch_pipeline_team_session")
    _, nonce, mac = session.split(".")
    _set_session(api, f"{int(time.time()) + 10 * 86400}.{nonce}.{mac}")
    assert api.get("/team", follow_redirects=False).status_code == 303
    _set_session(api, session)
    assert api.get("/team", follow_redirects=False).status_code == 200
    # The key taken out of the tenants file: its session ends at once.
    _write_tenants(tmp_path / "tenants.yaml", teams, team_a_keys=("a-new-key-of-team-a",))
    assert api.get("/team", follow_redirects=False).status_code == 303


def test_a_session_forged_from_the_tenants_files_digests_is_no_session(api, teams):
    """The tenants file (a ConfigMap in a cluster) holds each key's digest, not a secret: whoever reads it
    must not be able to sign an admin's session from it."""
    theirs = _submit(api, TEAM_B_KEY, teams["b"] / "out.json", {"project": "bravo-secret"})
    _log_in(api, TEAM_A_KEY)
    expires, nonce = int(time.time()) + 3600, "forged-nonce"
    for signed_with in (bytes.fromhex(_digest(ADMIN_KEY)), b""):
        for message in (
            f"batch_pipeline team page session\x00{expires}\x00{nonce}".encode(),
            b"batch_pipeline team page session\x00%s\x00%d\x00%s"
            % (bytes.fromhex(_digest(ADMIN_KEY)), expires, nonce.encode()),
        ):
            mac = base64.urlsafe_b64encode(hmac.new(signed_with, message, "sha256").digest()).decode().rstrip("=")
            _set_session(api, f"{expires}.{nonce}.{mac}")
            page = api.get("/team", follow_redirects=False)
            assert page.status_code == 303 and theirs not in page.text


def test_login_and_logout_refuse_a_form_from_another_site(api, teams):
    # No login form's token (a cross-site form cannot read or set it): refused, naming the field.
    refused = api.post("/team/login", data={"key": TEAM_A_KEY, "csrf": "made-up"}, follow_redirects=False)
    assert refused.status_code == 403 and "csrf" in refused.text
    form = api.get("/team/login")
    csrf = re.search(r'name="csrf" value="([^"]+)"', form.text).group(1)
    cross_site = api.post(
        "/team/login",
        data={"key": TEAM_A_KEY, "csrf": csrf},
        headers={"origin": "https://evil.example", "sec-fetch-site": "cross-site"},
        follow_redirects=False,
    )
    assert cross_site.status_code == 403 and "batch_pipeline_team_session" not in api.cookies
    assert _log_in(api, TEAM_A_KEY).status_code == 303
    # Logging out takes the page's own token; without it the session stays.
    assert api.post("/team/logout", data={}).status_code == 403
    assert api.get("/team", follow_redirects=False).status_code == 200
    token = re.search(r'action="/team/logout"><input type="hidden" name="csrf" value="([^"]+)"', api.get("/team").text)
    session = api.cookies.get("batch_pipeline_team_session")
    out = api.post("/team/logout", data={"csrf": token.group(1)}, follow_redirects=False)
    assert out.status_code == 303 and out.headers["location"] == "/team/login"
    assert api.get("/team", follow_redirects=False).status_code == 303
    # A copy of the cookie kept from before (another tab, a stolen copy) ended with it, on the server.
    _set_session(api, session)
    assert api.get("/team", follow_redirects=False).status_code == 303
    time.sleep(1.1)  # a session's expiry is in whole seconds: the next one's is later than the ended one's
    api.cookies.clear()
    assert _log_in(api, TEAM_A_KEY).status_code == 303
    assert api.get("/team", follow_redirects=False).status_code == 200


def test_a_login_form_past_its_bound_is_refused_naming_the_form(api, teams):
    # Read before anyone is known: an anonymous client's megabytes are not held.
    form = api.get("/team/login")
    csrf = re.search(r'name="csrf" value="([^"]+)"', form.text).group(1)
    huge = api.post("/team/login", data={"key": "x" * 2_000_000, "csrf": csrf}, follow_redirects=False)
    assert huge.status_code == 413 and "the form: at most 16384 bytes" in huge.text
    many = api.post(
        "/team/login",
        content="&".join(f"f{i}=1" for i in range(50)),
        follow_redirects=False,
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert many.status_code == 413
    assert _log_in(api, TEAM_A_KEY).status_code == 303


def test_a_label_holding_script_is_escaped_on_every_page(api, teams):
    hostile = _submit(api, TEAM_A_KEY, teams["a"] / "out.json", {HOSTILE_LABEL: HOSTILE_LABEL, "x": '"><img src=x>'})
    _log_in(api, ADMIN_KEY)  # the admin's browser is the one worth attacking
    for path in ("/team", f"/team/jobs/{hostile}"):
        page = api.get(path)
        assert page.status_code == 200
        assert "<script>alert" not in page.text and "<img src=x>" not in page.text
        assert "&lt;script&gt;alert(&quot;owned&quot;)&lt;/script&gt;" in page.text
        # And were anything to slip through, the browser runs only this origin's own script file.
        policy = page.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "unsafe-inline" not in policy
        assert page.headers["x-content-type-options"] == "nosniff"
    # The page's own markup holds no inline script for a policy to have to allow.
    assert not re.search(r"<script(?![^>]*\bsrc=)", api.get("/team").text)


# --- a real browser ----------------------------------------------------------------------------------------


def _serve(app) -> tuple[str, object]:
    import uvicorn

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the API did not start"
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server


class Browser:
    """Headless Chromium, driven through its DevTools protocol: a page that navigates, runs script, and
    takes screenshots, as a user's browser would (its cookies, its CSP, its script)."""

    def __init__(self, profile: Path) -> None:
        import websocket

        binary = shutil.which("chromium") or shutil.which("chromium-browser")
        assert binary, "chromium is not installed (.ci/run installs Debian's chromium)"
        self.process = subprocess.Popen(
            [
                binary,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--hide-scrollbars",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        while not (match := re.search(r"ws://127\.0\.0\.1:(\d+)/", self.process.stderr.readline())):
            assert time.monotonic() < deadline and self.process.poll() is None, "chromium did not start"
        port = match.group(1)
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        page = next(target for target in targets if target["type"] == "page")
        self.socket = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=30, suppress_origin=True)
        self._next_id = 0
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=1280, height=800, deviceScaleFactor=1, mobile=False)

    def call(self, method: str, **params) -> dict:
        self._next_id += 1
        self.socket.send(json.dumps({"id": self._next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv())
            if message.get("id") == self._next_id:
                assert "error" not in message, message
                return message["result"]

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30):
        deadline = time.monotonic() + timeout
        while not (value := self.evaluate(expression)):
            assert time.monotonic() < deadline, (
                f"timed out waiting for {expression} on {self.evaluate('location.href + document.body.innerText')}"
            )
            time.sleep(0.2)
        return value

    def open(self, url: str, path: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait_for(f"location.pathname === {json.dumps(path)} && document.readyState === 'complete'")

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        self.socket.close()
        self.process.terminate()
        self.process.wait(timeout=30)


@pytest.mark.slow  # a real browser: 25-45 s on 2 cores
def test_in_headless_chromium_a_team_logs_in_sees_its_jobs_follow_and_not_another_teams(api, teams, tmp_path):
    queued = _submit(api, TEAM_A_KEY, teams["a"] / "queued.json", {"project": "apollo"})
    running = _submit(api, TEAM_A_KEY, teams["a"] / "running.json", {"project": "apollo", "stage": "eval"})
    store = api.app.state.job_service.store
    store.link_run(running, "run-of-" + running)
    assert store.mark_started(running, "run-of-" + running)
    ShardProgressStore(engine=store.engine).record_shards(
        running, {0: 4}
    )  # what plan_shards and the shard's worker record as it goes
    ShardProgressStore(engine=store.engine).record_shard_progress(running, 0, {"requests_done": 1})
    done = _submit(api, TEAM_A_KEY, teams["a"] / "done.json", {"project": "apollo"})
    _completed_with_output(api, done, teams["a"] / "done.json")
    theirs = _submit(api, TEAM_B_KEY, teams["b"] / "out.json", {"project": "bravo-secret"})
    url, server = _serve(api.app)
    browser = Browser(tmp_path / "chromium-profile")
    try:
        browser.open(f"{url}/team", "/team/login")  # no session yet: the login form
        browser.evaluate(
            f"document.getElementById('key').value = {json.dumps(TEAM_A_KEY)};"
            "document.querySelector('form.login').requestSubmit()"
        )
        browser.wait_for("location.pathname === '/team' && document.readyState === 'complete'")
        text = browser.evaluate("document.body.innerText")
        assert queued in text and running in text and done in text and "apollo" in text
        assert theirs not in text and "bravo-secret" not in text
        assert browser.evaluate("document.cookie") == ""  # HttpOnly: no script of the page reads the session
        screenshots = {"jobs": tmp_path / "team-page.png", "job": tmp_path / "team-page-job.png"}
        browser.screenshot(screenshots["jobs"])

        # The page follows a job while it is queued or running, without a reload (the page's own script,
        # which its CSP admits, polls its status): its progress as its worker reports it, and a cancel.
        browser.evaluate("window.notReloaded = true")
        progress = f"document.querySelector('tr[data-job-id=\"{running}\"] [data-field=progress]').textContent"
        assert browser.evaluate(progress) == "1/4"
        ShardProgressStore(engine=store.engine).record_shard_progress(running, 0, {"requests_done": 3})
        browser.wait_for(f"{progress} === '3/4'", timeout=30)
        row = f"document.querySelector('tr[data-job-id=\"{queued}\"] [data-field=status]').textContent"
        assert browser.evaluate(row) == "queued"
        cancel = api.post(f"/v2/batch-completions/{queued}/actions/cancel", headers={"x-api-key": TEAM_A_KEY})
        assert cancel.json() == {"success": True}
        browser.wait_for(f"{row} === 'cancelled'", timeout=60)  # a queued job's row: every 15 s
        assert browser.evaluate("window.notReloaded") is True

        # A job's page: its error entry, and its output downloaded with the session.
        browser.open(f"{url}/team/jobs/{done}", f"/team/jobs/{done}")
        assert "prompt_too_long" in browser.evaluate("document.body.innerText")
        browser.screenshot(screenshots["job"])
        fetched = browser.evaluate(f"fetch('/team/jobs/{done}/output').then(r => r.text())")
        assert json.loads(fetched)[0]["text"] == " Paris."
        assert browser.evaluate(f"fetch('/team/jobs/{theirs}/output').then(r => r.status)") == 404
    finally:
        browser.close()
        server.should_exit = True
    from PIL import Image

    for screenshot in screenshots.values():
        with Image.open(screenshot) as image:
            assert image.size == (1280, 800)
            colors = image.convert("L").getcolors(maxcolors=1 << 16)
            assert colors is None or len(colors) > 20  # a rendered page, not a blank one
    # How docs/team-page.png and docs/team-page-job.png are made (docs/team-page.md).
    if target := os.environ.get("BATCH_PIPELINE_SCREENSHOT"):
        shutil.copy(screenshots["jobs"], target)
        shutil.copy(screenshots["job"], Path(target).with_name(Path(target).stem + "-job.png"))
