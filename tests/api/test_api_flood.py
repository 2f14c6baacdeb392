"""No team can stop the others: one team's flood of large bodies, its slow dry runs, and slow clients, against
the real API (`serve`'s uvicorn command line in a process of its own, real HTTP on 127.0.0.1), while another
team's requests are answered. Two API keys are two teams (each key owns its jobs)."""

import asyncio
import json
import os
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from batch_pipeline.api.limits import LargeBodySlots, TeamBusy
from batch_pipeline.entrypoints.serve import api_command
from tests.api_fixtures import REPO, write_instance_config
from tests.conftest import MODEL

TEAM_A, TEAM_B = {"x-api-key": "key-team-a"}, {"x-api-key": "key-team-b"}
FLOOD = 48  # as many large bodies at once as filled AnyIO's 40 worker threads, and hung every `def` route
# Generous on two shared cores: the hang this guards against was infinite.
ANSWERED_WITHIN_S = 10.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Api:
    """The API as `serve` runs it: `api_command`'s uvicorn, in its own process and DAGSTER_HOME."""

    def __init__(self, tmp_path: Path, **settings: str) -> None:
        home = tmp_path / "dagster_home"
        write_instance_config(home, max_concurrent_runs=0)  # nothing is launched: the API alone is under test
        self.log = tmp_path / "api.log"
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        environment = {key: value for key, value in os.environ.items() if not key.startswith("BATCH_PIPELINE_")}
        environment |= {
            "DAGSTER_HOME": str(home),
            "BATCH_PIPELINE_JOBS_DB": f"sqlite:///{home}/batch_jobs.db",
            "BATCH_PIPELINE_API_KEYS": f"{TEAM_A['x-api-key']},{TEAM_B['x-api-key']}",
            **{f"BATCH_PIPELINE_{name.upper()}": value for name, value in settings.items()},
        }
        self.process = subprocess.Popen(
            api_command("127.0.0.1", self.port),
            cwd=REPO,
            env=environment,
            stdout=open(self.log, "wb"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert self.process.poll() is None and time.monotonic() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.2)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture
def api_factory(tmp_path):
    started: list[Api] = []

    def start(**settings: str) -> Api:
        api = Api(tmp_path / f"api{len(started)}", **settings)
        started.append(api)
        return api

    yield start
    for api in started:
        api.stop()


def _body(tmp_path: Path, prompts: list[str]) -> dict:
    return {
        "output_data_path": str(tmp_path / "out" / "output.json"),
        "model_config": {"model": MODEL},
        "content": {"prompts": prompts, "max_new_tokens": 1, "temperature": 0.0},
    }


def _large_body(tmp_path: Path) -> bytes:
    """A valid request of about 8.6 MiB, over the 8 MiB past which a body takes a large-body slot."""
    raw = json.dumps(_body(tmp_path, ["x" * 1000] * 9000)).encode()
    assert 8.5 * 2**20 < len(raw) < 8.7 * 2**20
    return raw


def _timed(call) -> tuple[float, httpx.Response]:
    started = time.monotonic()
    response = call()
    return time.monotonic() - started, response


def _team_b_round(client: httpx.Client, tmp_path: Path, job_id: str) -> list[tuple[str, float, int]]:
    """Team B's GET, LIST and a small POST, each with how long it took and its status."""
    calls = {
        "GET": lambda: client.get(f"/v2/batch-completions/{job_id}"),
        "LIST": lambda: client.get("/v2/batch-completions", params={"limit": 5}),
        "POST": lambda: client.post("/v2/batch-completions", json=_body(tmp_path, ["Hello"])),
    }
    answers = []
    for name, call in calls.items():
        try:
            seconds, response = _timed(call)
        except httpx.TimeoutException:
            pytest.fail(f"team B's {name} was not answered within {client.timeout.read} s during team A's flood")
        answers.append((name, seconds, response.status_code))
    return answers


@pytest.mark.slow
def test_one_teams_flood_of_large_bodies_leaves_another_teams_requests_answered(api_factory, tmp_path):
    api = api_factory()
    large = _large_body(tmp_path)
    with (
        httpx.Client(base_url=api.url, headers=TEAM_B, timeout=30) as team_b,
        httpx.Client(
            base_url=api.url,
            headers={**TEAM_A, "content-type": "application/json"},
            timeout=90,
            limits=httpx.Limits(max_connections=FLOOD),
        ) as team_a,
    ):
        created = team_b.post("/v2/batch-completions", json=_body(tmp_path, ["Hello"]))
        assert created.status_code == 200, created.text
        job_id = created.json()["job_id"]

        def flood_one(_: int) -> int | str:
            try:
                return team_a.post("/v2/batch-completions", content=large).status_code
            except httpx.TimeoutException:
                return "no answer"

        with ThreadPoolExecutor(max_workers=FLOOD) as pool:
            flood = [pool.submit(flood_one, i) for i in range(FLOOD)]
            during: list[tuple[str, float, int]] = []
            team_b_large = None
            while not all(future.done() for future in flood) or not during:
                during += _team_b_round(team_b, tmp_path, job_id)
                if team_b_large is None:  # one large body of its own: its team's turn comes, whatever A queued
                    team_b_large = _timed(
                        lambda: team_b.post(
                            "/v2/batch-completions", content=large, headers={"content-type": "application/json"}
                        )
                    )
            answers = [future.result() for future in flood]
        after = _team_b_round(team_b, tmp_path, job_id)

    assert all(answer in (200, 413, 429) for answer in answers), answers  # every one answered, none hung
    assert answers.count(200) >= 1 and answers.count(429) >= 1, answers  # served within the team's bound
    for name, seconds, status in during + after:
        assert status == 200 and seconds < ANSWERED_WITHIN_S, (name, seconds, status, during, after)
    assert team_b_large is not None
    seconds, response = team_b_large
    assert response.status_code == 200 and seconds < 3 * ANSWERED_WITHIN_S, (seconds, response.text)


@pytest.mark.slow
def test_a_team_past_its_large_bodies_gets_429_naming_the_setting(api_factory, tmp_path):
    api = api_factory(max_large_bodies_per_team="1", max_concurrent_large_bodies="1")
    large = _large_body(tmp_path)
    with httpx.Client(base_url=api.url, headers={**TEAM_A, "content-type": "application/json"}, timeout=60) as client:
        with ThreadPoolExecutor(max_workers=4) as pool:
            answers = list(pool.map(lambda _: client.post("/v2/batch-completions", content=large), range(4)))
    statuses = sorted(response.status_code for response in answers)
    assert statuses[0] == 200 and 429 in statuses, statuses
    refused = next(response for response in answers if response.status_code == 429)
    assert "BATCH_PIPELINE_MAX_LARGE_BODIES_PER_TEAM" in refused.json()["detail"]
    assert refused.headers["retry-after"] == "5"


def _closed_within(connection: socket.socket, seconds: float) -> tuple[bytes, float]:
    """What the server sent before it closed the connection, and when it closed; fails if it stays open."""
    connection.settimeout(seconds)
    started, received = time.monotonic(), b""
    try:
        while chunk := connection.recv(65536):
            received += chunk
    except TimeoutError:
        pytest.fail(f"the server kept the connection open past {seconds} s; it sent {received[:200]!r}")
    return received, time.monotonic() - started


@pytest.mark.slow  # a real `serve` process; clients held to its timeouts
def test_slow_clients_are_closed_at_their_timeouts_while_others_are_served(api_factory, tmp_path):
    api = api_factory(header_timeout_s="2", body_idle_timeout_s="2", body_timeout_s="4")
    connections = [socket.create_connection(("127.0.0.1", api.port)) for _ in range(4)]
    silent, slow_head, idle_body, trickled_body = connections
    slow_head.sendall(b"GET /v2/batch-completions HTTP/1.1\r\nHost: 127.0.0.1\r\nx-api-key: key-team-a\r\n")
    head = (
        b"POST /v2/batch-completions HTTP/1.1\r\nHost: 127.0.0.1\r\nx-api-key: key-team-a\r\n"
        b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n"
    )
    idle_body.sendall(head + b'{"output_data_path": ')
    trickled_body.sendall(head)
    with httpx.Client(base_url=api.url, headers=TEAM_B, timeout=10) as others:
        served = others.get("/v2/batch-completions")  # while four connections are held open
        assert served.status_code == 200
        # A byte a second keeps within the pause between chunks, not within the whole body's time.
        started = time.monotonic()
        trickled_body.setblocking(False)
        try:
            while time.monotonic() - started < 10:
                trickled_body.send(b" ")
                time.sleep(1)
        except (BrokenPipeError, ConnectionResetError, BlockingIOError):
            pass
        trickled_body.setblocking(True)
        assert others.get("/healthz").status_code == 200
    for connection in (silent, slow_head):  # both were opened more than 2 s ago: closed by now, answered nothing
        assert _closed_within(connection, 3)[0] == b""
    for connection in (idle_body, trickled_body):
        received, _ = _closed_within(connection, 3)
        assert received.startswith(b"HTTP/1.1 408"), received[:200]
        assert b"did not arrive in time" in received
    for connection in connections:
        connection.close()


@pytest.mark.slow  # a real `serve` process; clients held to its timeouts
def test_a_header_sent_a_byte_at_a_time_does_not_hold_the_connection(api_factory):
    api = api_factory(header_timeout_s="2")
    connection = socket.create_connection(("127.0.0.1", api.port))
    started = time.monotonic()
    closed_after = None
    for byte in b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nx-padding: " + b"a" * 100:
        try:
            connection.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            closed_after = time.monotonic() - started
            break
        connection.settimeout(0.3)
        try:
            if connection.recv(1) == b"":
                closed_after = time.monotonic() - started
                break
        except TimeoutError:
            pass
    connection.close()
    assert closed_after is not None and closed_after < 2 + 2, closed_after


def _server_sockets(pid: int) -> int:
    """How many sockets the API's process has open: its listening one and one for each connection."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            count += os.readlink(fd).startswith("socket:")
        except FileNotFoundError:  # closed while listed
            pass
    return count


def _rest_until_closed(connection: socket.socket, seconds: float) -> int:
    """How many bytes the client reads before the server's close, reading now; fails if it stays open."""
    connection.settimeout(seconds)
    received = 0
    try:
        while chunk := connection.recv(1 << 20):
            received += len(chunk)
    except ConnectionResetError:  # aborted: what was still unread may be dropped
        pass
    except TimeoutError:
        pytest.fail(f"the server kept the connection open past {seconds} s; it sent {received} bytes")
    return received


SLOW_READERS = 20


@pytest.mark.slow  # a real `serve` process; clients held to its timeouts
@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts the API's sockets in /proc")
def test_clients_that_never_read_their_responses_are_closed_at_the_write_timeout(api_factory, tmp_path):
    # Before BATCH_PIPELINE_WRITE_TIMEOUT_S, 150 such clients each held ~2.2 MiB of the API for ever.
    api = api_factory(write_timeout_s="2", header_timeout_s="2")
    content = b"".join(b'{"custom_id": "request-%07d"}\n' % i for i in range(8 * 2**20 // 30))
    with httpx.Client(base_url=api.url, headers=TEAM_A, timeout=30) as team_a:
        uploaded = team_a.post("/v1/files", files={"file": ("input.jsonl", content)}, data={"purpose": "batch"})
        assert uploaded.status_code == 200, uploaded.text
        file_id = uploaded.json()["id"]
        at_rest = _server_sockets(api.process.pid)
        request = (
            f"GET /v1/files/{file_id}/content HTTP/1.1\r\nHost: 127.0.0.1\r\nx-api-key: key-team-a\r\n\r\n"
        ).encode()
        readers = []
        for _ in range(SLOW_READERS):
            reader = socket.socket()
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
            reader.connect(("127.0.0.1", api.port))
            reader.sendall(request)
            readers.append(reader)
        opened = time.monotonic()
        # While they hold their connections, a client that reads gets the whole file, and others are answered.
        assert team_a.get(f"/v1/files/{file_id}/content").content == content
        with httpx.Client(base_url=api.url, headers=TEAM_B, timeout=10) as others:
            assert others.get("/v2/batch-completions").status_code == 200
        while _server_sockets(api.process.pid) > at_rest and time.monotonic() - opened < 2 + 10:
            time.sleep(0.2)
        still_open = _server_sockets(api.process.pid) - at_rest
        assert still_open <= 0, f"{still_open} of {SLOW_READERS} connections never read are still open"
        for reader in readers:  # closed by the server, with the response cut short
            assert _rest_until_closed(reader, 5) < len(content)
            reader.close()
        assert team_a.get("/healthz").status_code == 200


def _response(connection: socket.socket, seconds: float) -> tuple[int, bytes]:
    """The status and body of the response read from a raw connection (a body of its content-length)."""
    connection.settimeout(seconds)
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = connection.recv(65536)
        assert chunk, f"the connection closed before a response: {received[:200]!r}"
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers["content-length"]):
        chunk = connection.recv(65536)
        assert chunk, "the connection closed within the response's body"
        body += chunk
    return int(lines[0].split()[1]), body


@pytest.mark.slow  # a real `serve` process; bodies trickled to it
def test_a_teams_trickled_bodies_past_its_bound_get_429_while_another_team_is_answered(api_factory, tmp_path):
    # Before BATCH_PIPELINE_MAX_BODIES_PER_TEAM, each body of 8 MiB or less held up to 1 MiB for up to 300 s,
    # with no bound per team: 200 trickled ones took 200 MiB of the API.
    bound, beyond = 8, 40
    api = api_factory(max_bodies_per_team=str(bound))
    length = 200_000
    raw = json.dumps(_body(tmp_path, ["Hello"])).encode().ljust(length)  # trailing spaces: still the JSON
    head = (
        "POST /v2/batch-completions HTTP/1.1\r\nHost: 127.0.0.1\r\nx-api-key: key-team-a\r\n"
        f"content-type: application/json\r\ncontent-length: {length}\r\n\r\n"
    ).encode()
    with httpx.Client(base_url=api.url, headers=TEAM_B, timeout=ANSWERED_WITHIN_S) as team_b:
        created = team_b.post("/v2/batch-completions", json=_body(tmp_path, ["Hello"]))
        assert created.status_code == 200, created.text
        sent = length // 2
        team_a = [socket.create_connection(("127.0.0.1", api.port)) for _ in range(bound + beyond)]
        try:
            for connection in team_a:
                connection.sendall(head + raw[:sent])
            during = []
            for _ in range(4):  # a byte each at a time, while team B's requests are answered
                for connection in team_a:
                    connection.sendall(raw[sent : sent + 1])
                sent += 1
                during += _team_b_round(team_b, tmp_path, created.json()["job_id"])
                time.sleep(0.5)
            for connection in team_a:
                connection.sendall(raw[sent:])
            answers = [_response(connection, 30) for connection in team_a]
        finally:
            for connection in team_a:
                connection.close()
        for name, seconds, status in during:
            assert status == 200 and seconds < ANSWERED_WITHIN_S, (name, seconds, status, during)
    statuses = [status for status, _ in answers]
    assert statuses.count(429) == beyond and statuses.count(200) == bound, statuses
    refused = next(json.loads(body) for status, body in answers if status == 429)
    assert "BATCH_PIPELINE_MAX_BODIES_PER_TEAM" in refused["detail"]


# A chat template that renders for hours: its dry run holds a slot until BATCH_PIPELINE_DRY_RUN_TIMEOUT_S.
TEMPLATE_WITHOUT_END = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"


def _chat_body(tmp_path: Path, template: str | None = None) -> dict:
    request: dict = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    if template is not None:
        request["chat_template"] = template
    return {**_body(tmp_path, []), "content": [request]}


@pytest.mark.slow
def test_one_teams_slow_dry_runs_hold_only_its_share_and_another_team_gets_a_slot(api_factory, tmp_path):
    # Each dry run checks its requests in a child that imports vLLM (~10 s); A's slow ones run past B's.
    api = api_factory(max_concurrent_dry_runs="2", dry_run_timeout_s="90")
    slow = _chat_body(tmp_path, TEMPLATE_WITHOUT_END)

    def dry_run(headers: dict, body: dict, timeout: float) -> httpx.Response:
        return httpx.post(
            f"{api.url}/v2/batch-completions", params={"dry_run": "true"}, json=body, headers=headers, timeout=timeout
        )

    pool = ThreadPoolExecutor(max_workers=2)
    team_a = [pool.submit(dry_run, TEAM_A, slow, 120) for _ in range(2)]
    try:
        refused = next(future.result() for future in _first_done(team_a, 30))
        assert refused.status_code == 429, refused.text
        assert "BATCH_PIPELINE_MAX_DRY_RUNS_PER_TEAM" in refused.json()["detail"]
        assert refused.headers["retry-after"] == "5"
        seconds, answered = _timed(lambda: dry_run(TEAM_B, _chat_body(tmp_path), 80))
        assert answered.status_code == 200, answered.text
        assert answered.json()["num_requests"] == 1
        assert not all(future.done() for future in team_a)  # A's slow one was holding its slot all along
    finally:
        api.stop()  # A's slow dry run is not waited for
        pool.shutdown(wait=True)


def _first_done(futures: list, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [future for future in futures if future.done()]
        if done:
            return done
        time.sleep(0.1)
    pytest.fail(f"no dry run was answered within {timeout} s")


# --- the large-body slots, shared between teams ---------------------------------------------------------------


def test_a_freed_slot_goes_to_the_next_team_in_turn_not_to_the_longest_queue():
    async def scenario() -> list[str]:
        slots = LargeBodySlots(slots=1, per_team=10)
        order: list[str] = []
        await slots.acquire("a")

        async def body(team: str) -> None:
            await slots.acquire(team)
            order.append(team)
            await asyncio.sleep(0)
            slots.release(team)

        waiting = [asyncio.create_task(body("a")) for _ in range(3)]
        await asyncio.sleep(0)
        waiting.append(asyncio.create_task(body("b")))
        await asyncio.sleep(0)
        slots.release("a")
        await asyncio.gather(*waiting)
        return order

    assert asyncio.run(scenario()) == ["a", "b", "a", "a"]


def test_a_team_holds_at_most_half_the_slots_and_has_at_most_its_bound_in_progress():
    async def scenario() -> None:
        slots = LargeBodySlots(slots=4, per_team=3)
        for _ in range(3):
            slots.enter("a")
        with pytest.raises(TeamBusy, match="BATCH_PIPELINE_MAX_LARGE_BODIES_PER_TEAM"):
            slots.enter("a")
        slots.enter("b")  # another team's bound is its own
        await slots.acquire("a")
        await slots.acquire("a")
        third = asyncio.create_task(slots.acquire("a"))  # two free slots, but A holds its half
        await asyncio.sleep(0)
        assert not third.done() and slots.counts("a") == (3, 2, 1)
        await asyncio.wait_for(slots.acquire("b"), 1)  # B takes a free slot at once
        slots.release("b")
        slots.release("a")
        await asyncio.wait_for(third, 1)
        assert slots.counts("a") == (3, 2, 0)

    asyncio.run(scenario())


def test_a_waiter_that_leaves_frees_its_place_and_its_turn():
    async def scenario() -> None:
        slots = LargeBodySlots(slots=1, per_team=4)
        await slots.acquire("a")
        leaving = asyncio.create_task(slots.acquire("b"))
        staying = asyncio.create_task(slots.acquire("c"))
        await asyncio.sleep(0)
        assert slots.counts("b") == (0, 0, 1)
        leaving.cancel()  # the client left while it waited
        await asyncio.gather(leaving, return_exceptions=True)
        assert slots.counts("b") == (0, 0, 0)
        slots.release("a")
        await asyncio.wait_for(staying, 1)  # the slot goes to the next that still waits
        assert slots.counts("c") == (0, 1, 0)

    asyncio.run(scenario())
