"""Signed webhooks when a job ends (issue 28 part 2): the outbox is written in the transaction that ends the
job; the delivery process sends each event, signed the Standard Webhooks way, to the endpoints the tenants
file gives the job's team, and nowhere else; a receiver that is down gets it once it is up again, one that
answers 500 or hangs is retried with backoff for 24 hours and then given up, visibly, and none delays a job.
The receivers are real HTTP servers that verify with the `standardwebhooks` library."""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import socket
import ssl
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from batch_pipeline.openai_batch.jobs import CUSTOM_IDS_FILE
from batch_pipeline.pipeline import sensors
from batch_pipeline.pipeline.partial_results import keep_partial_results
from batch_pipeline.pipeline.resources import JobStorage
from batch_pipeline.pipeline.tags import JOB_ID_TAG
from batch_pipeline.store.jobs import JobStore
from batch_pipeline.store.openai import OpenAIStore, batches
from batch_pipeline.store.progress import ShardProgressStore
from batch_pipeline.store.records import NewJob
from batch_pipeline.store.schema import JobStatus
from batch_pipeline.store.webhooks import PARTIAL_RESULTS_WAIT, WebhookOutbox
from batch_pipeline.tenancy.tenants import Tenants, TenantsFileError, WebhookConfig
from batch_pipeline.webhooks import delivery
from batch_pipeline.webhooks.delivery import Deliverer, WebhookSecretError, check_webhook_secrets
from tests.api_fixtures import sensor_resources
from tests.conftest import MODEL

ALPHA, BETA = "key-of-team-alpha", "key-of-team-beta"
# The receivers here listen on loopback, which is no public address: the operator allows it, as
# BATCH_PIPELINE_WEBHOOK_ALLOW_PRIVATE_NETWORKS would.
LOOPBACK = "127.0.0.0/8"
ALPHA_SECRET = "whsec_" + base64.b64encode(b"alpha's secret of 24 bytes").decode()
BETA_SECRET = "whsec_" + base64.b64encode(b"beta's own secret, 24 byte").decode()


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Receiver:
    """A webhook receiver on a local port: verifies each delivery with the standardwebhooks library and
    answers `mode`: "ok" (204), "500", "hang" (holds the request until released), or "drip" (sends its
    answer a byte every 0.2 s, far inside any read timeout, until released or cut off by the sender).
    `reads`: what a receiver reacting to the event looks up as it arrives (the job's output), kept in
    `read_back`."""

    def __init__(
        self,
        secret: str,
        mode: str = "ok",
        port: int = 0,
        reads: Callable[[], Any] | None = None,
        host: str = "127.0.0.1",
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.verifier = Webhook(secret)
        self.mode = mode
        self.received: list[dict] = []  # {"headers", "body", "verified", "payload"}
        self.read_back: list[Any] = []
        self.release = threading.Event()
        self.cut_off = threading.Event()  # a dripped answer's connection was closed by the sender
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                headers = {name.lower(): value for name, value in self.headers.items()}
                try:
                    payload, verified = receiver.verifier.verify(body, headers), True
                except WebhookVerificationError:
                    payload, verified = None, False
                receiver.received.append({"headers": headers, "body": body, "verified": verified, "payload": payload})
                if reads is not None:
                    receiver.read_back.append(reads())
                if receiver.mode == "drip":
                    self.drip()
                    return
                if receiver.mode == "hang":
                    receiver.release.wait(120)
                status = 500 if receiver.mode == "500" else 204 if verified else 400
                try:
                    self.send_response(status)
                    self.send_header("content-length", "0")
                    self.end_headers()
                except OSError:
                    pass  # the sender gave up waiting

            def drip(self) -> None:
                answer = itertools.chain(b"HTTP/1.1 204 No Content\r\nx-drip: ", itertools.repeat(ord("a")))
                until = time.monotonic() + 120
                for byte in answer:
                    if receiver.release.wait(0.2) or time.monotonic() > until:
                        return
                    try:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                    except OSError:
                        receiver.cut_off.set()
                        return

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.url = f"{'https' if tls else 'http'}://{host}:{self.port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def verified_payloads(self) -> list[dict]:
        return [entry["payload"] for entry in self.received if entry["verified"]]

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


_LOOPBACK_ALLOWED = {"allowed_networks": delivery.private_networks(LOOPBACK)}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _store_batch(store: JobStore, batch_id: str, total: int) -> None:
    """Team alpha's OpenAI batch row, as the API stores it when the batch is created."""
    with store.engine.begin() as connection:
        connection.execute(
            batches.insert().values(
                batch_id=batch_id,
                owner="team:alpha",
                endpoint="/v1/chat/completions",
                input_file_id="file-1",
                completion_window="24h",
                created_at=datetime.now(UTC),
                total=total,
            )
        )


def _new_job(owner: str, reason: str | None = None, job_id: str | None = None, output: str = "/tmp/o.json") -> NewJob:
    request = {"output_data_path": output, "model_config": {"model": MODEL}, "input_data_path": "/tmp/i.json"}
    return NewJob(
        job_id=job_id or NewJob.new_id(),
        owner=owner,
        request_json=json.dumps(request),
        request_sha256="0" * 64,
        model=MODEL,
        priority=None,
        labels={},
        max_runtime_sec=60,
        failure_reason=reason,
    )


@pytest.fixture
def store(tmp_path) -> JobStore:
    return JobStore(f"sqlite:///{tmp_path}/jobs.db")


def _events(store: JobStore, job_id: str) -> list:
    return WebhookOutbox(engine=store.engine).events_of_job(job_id)


def test_one_teams_many_events_never_take_every_delivery_worker(store):
    """Found by an attacker review: the claim took the oldest due events whoever they belonged to, so a team
    ending 20 jobs at once (cancelled before launch) filled all 8 workers, and a receiver of its that
    trickles its answer kept every other team's webhooks waiting."""
    for _ in range(20):
        job, _ = store.create(_new_job("team:alpha"))
        assert store.cancel_before_launch(job.job_id)
    beta, _ = store.create(_new_job("team:beta"))
    assert store.cancel_before_launch(beta.job_id)
    outbox = WebhookOutbox(engine=store.engine)
    now = datetime.now(UTC) + timedelta(seconds=1)

    claimed = outbox.claim_due(now, 8, delivery.LEASE, delivery.PER_TEAM_IN_FLIGHT)
    assert sorted(event.owner for event in claimed) == ["team:alpha", "team:alpha", "team:beta"]
    # With alpha's two in flight, the next tick claims none of alpha's, however many are due.
    later = outbox.claim_due(now, 8, delivery.LEASE, delivery.PER_TEAM_IN_FLIGHT, {"team:alpha": 2})
    assert later == []


# --- the outbox: written with the end, in the same transaction ---------------------------------------------


def test_each_way_a_job_ends_writes_one_event_of_its_owner_with_the_end(store):
    cancelled, _ = store.create(_new_job("team:alpha"))
    assert _events(store, cancelled.job_id) == []  # a queued job announces nothing
    assert store.cancel_before_launch(cancelled.job_id)
    [event] = _events(store, cancelled.job_id)
    assert (event.type, event.owner, event.state, event.attempts) == ("job.cancelled", "team:alpha", "pending", 0)
    assert json.loads(event.payload) == {
        "type": "job.cancelled",
        "timestamp": json.loads(event.payload)["timestamp"],
        "data": {"job_id": cancelled.job_id, "status": "cancelled"},
    }

    expired, _ = store.create(_new_job("team:alpha"))
    store.mark_failed(expired.job_id, "max_runtime_sec exceeded: the job's deadline passed while it waited")
    assert [e.type for e in _events(store, expired.job_id)] == ["job.expired"]

    ran, _ = store.create(_new_job("team:beta"))
    store.mark_started(ran.job_id, "run-1")
    assert _events(store, ran.job_id) == []
    ended = datetime.now(UTC)
    store.mark_run_ended(ran.job_id, "run-1", JobStatus.COMPLETED, ended)
    store.mark_run_ended(ran.job_id, "run-1", JobStatus.COMPLETED, ended)  # recorded again (a late sensor)
    assert [(e.type, e.owner) for e in _events(store, ran.job_id)] == [("job.completed", "team:beta")]
    store.mark_started(ran.job_id, "run-2")  # re-executed from the UI: a new end is a new event
    store.mark_run_ended(ran.job_id, "run-2", JobStatus.FAILED, datetime.now(UTC), reason="boom")
    assert [e.type for e in _events(store, ran.job_id)] == ["job.completed", "job.failed"]

    stopped, _ = store.create(_new_job("team:beta"))
    store.mark_started(stopped.job_id, "run-3")
    store.mark_cancelled(stopped.job_id)
    assert _events(store, stopped.job_id) == []  # its end is when its run ends
    store.mark_run_ended(stopped.job_id, "run-3", JobStatus.CANCELLED, datetime.now(UTC))
    assert [e.type for e in _events(store, stopped.job_id)] == ["job.cancelled"]


def test_an_openai_batch_announces_openais_batch_event_shape(store):
    batch_id = NewJob.new_id()
    _store_batch(store, batch_id, total=1)  # the batch row is stored before its job, as the API does
    store.create(_new_job("team:alpha", reason="the input file did not validate", job_id=batch_id))
    [event] = _events(store, batch_id)
    payload = json.loads(event.payload)
    assert event.type == "batch.failed" and payload == {
        "id": event.event_id,
        "object": "event",
        "created_at": payload["created_at"],
        "type": "batch.failed",
        "data": {"id": batch_id},
    }
    assert event.event_id.startswith("evt_") and isinstance(payload["created_at"], int)


def test_an_end_whose_event_cannot_be_written_does_not_happen(store):
    """Same transaction: when the outbox insert fails, the job's status change is rolled back with it."""
    job, _ = store.create(_new_job("team:alpha"))
    with store.engine.begin() as connection:
        connection.execute(
            sa.text(
                "CREATE TRIGGER no_events BEFORE INSERT ON batch_webhook_events BEGIN SELECT RAISE(ABORT, 'x'); END"
            )
        )
    with pytest.raises(sa.exc.IntegrityError):
        store.cancel_before_launch(job.job_id)
    assert store.get(job.job_id).status == JobStatus.QUEUED and store.get(job.job_id).completed_at is None
    store.mark_started(job.job_id, "run-1")
    with pytest.raises(sa.exc.IntegrityError):
        store.mark_run_ended(job.job_id, "run-1", JobStatus.COMPLETED, datetime.now(UTC))
    assert store.get(job.job_id).status == JobStatus.RUNNING
    with store.engine.begin() as connection:
        connection.execute(sa.text("DROP TRIGGER no_events"))
    store.mark_run_ended(job.job_id, "run-1", JobStatus.COMPLETED, datetime.now(UTC))
    assert [e.type for e in _events(store, job.job_id)] == ["job.completed"]


# --- a stopped job: announced once keep_partial_results has written its output --------------------------------


@dg.op
def _generate() -> None:
    pass


@dg.job
def _a_batch_run():
    _generate()


class StoppedJob:
    """A job whose run is cancelled after its shards finished two of its three requests (their checkpoints
    as a worker leaves them), as the real status sensor records it; for a batch, its batch row and custom
    ids as the API stores them. `request` is the run request of keep_partial_results the sensor returned."""

    def __init__(self, store: JobStore, instance: dg.DagsterInstance, tmp_path: Path, batch: bool = False) -> None:
        self.store, self.instance = store, instance
        self.storage = JobStorage(work_dir_base=str(tmp_path / "work"))
        self.output = tmp_path / "out" / "output.json"
        self.job_id = NewJob.new_id()
        if batch:
            _store_batch(store, self.job_id, total=3)
        store.create(_new_job("team:alpha", job_id=self.job_id, output=str(self.output)))
        run = instance.create_run_for_job(_a_batch_run, tags={JOB_ID_TAG: self.job_id})
        store.mark_started(self.job_id, run.run_id)
        work_dir = Path(self.storage.work_dir(self.job_id))
        for shard, (items, results) in enumerate([([0, 2], {0: "a"}), ([1], {1: "b"})]):
            directory = work_dir / "shards" / f"{shard:03d}"
            directory.mkdir(parents=True)
            (directory / "input.jsonl").write_text(
                "".join(json.dumps({"index": i, "kind": "v1", "request": {}}) + "\n" for i in items)
            )
            (directory / "results.tsv").write_text(
                "".join(f"{i}\t{json.dumps({'text': text})}\n" for i, text in results.items())
            )
        (work_dir / CUSTOM_IDS_FILE).write_text("".join(json.dumps(f"request-{i}") + "\n" for i in range(3)))
        ShardProgressStore(engine=store.engine).record_shards(self.job_id, {0: 2, 1: 1})
        store.mark_cancelled(self.job_id)  # the user's cancel; the run then stops
        cancelled = instance.report_run_canceled(run)
        run = instance.get_run_by_id(run.run_id)
        context = dg.build_run_status_sensor_context(
            sensor_name="record_stopped_runs",
            dagster_event=cancelled,
            dagster_instance=instance,
            dagster_run=run,
            resources=sensor_resources(str(store.engine.url)),
        )
        record_stopped_runs = next(s for s in sensors.run_end_sensors(interval_s=1) if s.name == "record_stopped_runs")
        self.request = record_stopped_runs(context)
        assert isinstance(self.request, dg.RunRequest)

    def keep_partial_results(self) -> dg.ExecuteInProcessResult:
        """The run the sensor asked for, as the daemon launches it."""
        return keep_partial_results.execute_in_process(
            run_config=self.request.run_config,
            tags=self.request.tags,
            instance=self.instance,
            resources=sensor_resources(str(self.store.engine.url), job_storage=self.storage),
            raise_on_error=False,
        )

    def what_a_receiver_reads(self) -> dict:
        """The job's output, and a batch's output and error files, as the API would answer them now."""
        batch = OpenAIStore(engine=self.store.engine).get_batch(self.job_id)
        return {
            "output": json.loads(self.output.read_text()) if self.output.exists() else None,
            "batch_files": (batch.output_file_id, batch.error_file_id) if batch else None,
        }


def _receiver_of(stopped: StoppedJob, monkeypatch) -> tuple[Receiver, Deliverer, Clock]:
    monkeypatch.setenv("ALPHA_SECRET", ALPHA_SECRET)
    receiver = Receiver(ALPHA_SECRET, reads=stopped.what_a_receiver_reads)
    endpoint = WebhookConfig(url=receiver.url, secret_env="ALPHA_SECRET")
    clock = Clock()
    deliverer = Deliverer(
        WebhookOutbox(engine=stopped.store.engine), endpoints=lambda owner: [endpoint], clock=clock, **_LOOPBACK_ALLOWED
    )
    return receiver, deliverer, clock


KEPT = [
    {"text": "a"},
    {"text": "b"},
    {"error": {"message": "the job was cancelled before this request finished", "type": "server_error",
               "param": None, "code": "cancelled"}},
]  # fmt: skip


@pytest.mark.parametrize("batch", [False, True], ids=["job", "batch"])
def test_a_stopped_jobs_end_is_announced_once_keep_partial_results_has_written_its_output(
    store, dagster_home, tmp_path, monkeypatch, batch
):
    """Found in issue 28's leftovers: the status sensor wrote a cancelled job's event with its end, and
    launched keep_partial_results, which merges the finished results into the output afterwards; a receiver
    told at once found no output (nor a batch's output and error files). The event is held until the
    transaction that records the output as final, and it is still one event."""
    stopped = StoppedJob(store, dagster_home, tmp_path, batch=batch)
    receiver, deliverer, clock = _receiver_of(stopped, monkeypatch)
    try:
        [event] = _events(store, stopped.job_id)
        assert event.type == ("batch.cancelled" if batch else "job.cancelled") and event.state == "pending"
        clock.now = datetime.now(UTC)
        _deliver_all(deliverer)
        assert receiver.received == [], f"announced before its output was written: {receiver.read_back}"

        assert stopped.keep_partial_results().success
        clock.now = datetime.now(UTC)
        _deliver_all(deliverer)
        [read] = receiver.read_back
        assert read["output"] == KEPT
        if batch:
            assert read["batch_files"][0] is not None and read["batch_files"][1] is not None
        assert [(e.type, e.state) for e in _events(store, stopped.job_id)] == [(event.type, "delivered")]

        # keep_partial_results run again (retried, or re-executed from the UI): nothing new is announced.
        assert stopped.keep_partial_results().success
        clock.now = datetime.now(UTC) + timedelta(hours=2)
        _deliver_all(deliverer)
        assert len(receiver.received) == 1 and len(_events(store, stopped.job_id)) == 1
    finally:
        deliverer.close()
        receiver.stop()


@pytest.mark.slow  # waits out keep_partial_results' retry delays (2 x 5 s)
def test_a_stopped_jobs_end_is_announced_when_keep_partial_results_gives_up_or_never_runs(
    store, dagster_home, tmp_path, monkeypatch
):
    """An event is never lost for an output that does not come: keep_partial_results failing its last retry
    releases it; one that never runs leaves it held for PARTIAL_RESULTS_WAIT after the end, and no longer."""
    never_kept = StoppedJob(store, dagster_home, tmp_path / "never")
    failing = StoppedJob(store, dagster_home, tmp_path / "failing")
    receiver, deliverer, clock = _receiver_of(failing, monkeypatch)
    try:
        failing.output.parent.write_text("a file where the output's directory should be")
        result = failing.keep_partial_results()
        assert not result.success and len([e for e in result.all_events if e.is_step_up_for_retry]) == 2
        clock.now = datetime.now(UTC)
        _deliver_all(deliverer)
        assert [p["data"]["job_id"] for p in receiver.verified_payloads()] == [failing.job_id]
        assert receiver.read_back[0]["output"] is None  # announced without the output that never came

        [held] = _events(store, never_kept.job_id)
        assert held.state == "pending" and held.attempts == 0
        clock.now = held.created_at + PARTIAL_RESULTS_WAIT - timedelta(minutes=1)
        _deliver_all(deliverer)
        assert len(receiver.received) == 1
        clock.now = held.created_at + PARTIAL_RESULTS_WAIT
        _deliver_all(deliverer)
        assert [p["data"]["job_id"] for p in receiver.verified_payloads()] == [failing.job_id, never_kept.job_id]

        # The failed one retried once the disk is fixed: its output is kept, and nothing more is announced.
        failing.output.parent.unlink()
        assert failing.keep_partial_results().success
        assert failing.what_a_receiver_reads()["output"] == KEPT
        clock.now += timedelta(hours=2)
        _deliver_all(deliverer)
        assert len(receiver.received) == 2
        assert [len(_events(store, job.job_id)) for job in (failing, never_kept)] == [1, 1]
    finally:
        deliverer.close()
        receiver.stop()


# --- the tenants file ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("webhook", "named"),
    [
        ("{url: 'ftp://example.com/x', secret_env: A}", "tenants.alpha.webhooks.0.url"),
        ("{url: 'https://user:pw@example.com/x', secret_env: A}", "tenants.alpha.webhooks.0.url"),
        ("{url: 'https://example.com/x', secret_env: 'not a name'}", "tenants.alpha.webhooks.0.secret_env"),
        ("{url: 'https://example.com/x', secret_env: A, events: [job.done]}", "tenants.alpha.webhooks.0.events"),
        ("{url: 'https://example.com/x', secret_env: A, secret: whsec_x}", "tenants.alpha.webhooks.0.secret"),
    ],
)
def test_a_wrong_webhook_in_the_tenants_file_is_named_with_its_field(tmp_path, webhook, named):
    path = tmp_path / "tenants.yaml"
    path.write_text(f"tenants:\n  alpha:\n    api_keys_sha256: [{_digest(ALPHA)}]\n    webhooks:\n      - {webhook}\n")
    with pytest.raises(TenantsFileError, match=f"^{path}:line 5: {named}"):
        Tenants.load(str(path))


def test_a_missing_or_malformed_secret_is_named_and_never_shown(tmp_path, monkeypatch):
    path = tmp_path / "tenants.yaml"
    path.write_text(
        f"tenants:\n  alpha:\n    api_keys_sha256: [{_digest(ALPHA)}]\n"
        "    webhooks: [{url: 'https://example.com/x', secret_env: ALPHA_WEBHOOK_SECRET}]\n"
    )
    registry = Tenants.load(str(path))
    monkeypatch.delenv("ALPHA_WEBHOOK_SECRET", raising=False)
    with pytest.raises(
        WebhookSecretError, match="tenants.alpha.webhooks.0.secret_env: secret_env ALPHA_WEBHOOK_SECRET is not set"
    ):
        check_webhook_secrets(registry)
    monkeypatch.setenv("ALPHA_WEBHOOK_SECRET", "whsec_%%%not-base64%%%")
    with pytest.raises(WebhookSecretError) as raised:
        check_webhook_secrets(registry)
    assert "not-base64" not in str(raised.value) and "is not a Standard Webhooks secret" in str(raised.value)
    monkeypatch.setenv("ALPHA_WEBHOOK_SECRET", ALPHA_SECRET)
    check_webhook_secrets(registry)


# --- delivery, against real receivers ------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now


def _deliver_all(deliverer: Deliverer) -> None:
    for future in deliverer.tick():
        future.result(timeout=60)


def test_a_receiver_answering_500_is_retried_with_backoff_and_given_up_after_24_hours_visibly(store, monkeypatch):
    monkeypatch.setenv("ALPHA_SECRET", ALPHA_SECRET)
    failing = Receiver(ALPHA_SECRET, mode="500")
    clock = Clock()
    endpoint = WebhookConfig(url=failing.url, secret_env="ALPHA_SECRET")
    deliverer = Deliverer(
        WebhookOutbox(engine=store.engine), endpoints=lambda owner: [endpoint], clock=clock, **_LOOPBACK_ALLOWED
    )
    try:
        job, _ = store.create(_new_job("team:alpha"))
        store.cancel_before_launch(job.job_id)
        clock.now = datetime.now(UTC)
        waits = []
        while (event := _events(store, job.job_id)[0]).state == "pending":
            _deliver_all(deliverer)
            event = _events(store, job.job_id)[0]
            if event.state == "pending":
                assert event.last_error == "webhooks[0]: HTTP 500"
                waits.append((event.next_attempt_at - clock.now).total_seconds())
                assert deliverer.tick() == []  # not due before its backoff
                clock.now = event.next_attempt_at
        assert event.state == "failed" and event.last_error == "webhooks[0]: HTTP 500"
        assert all(entry["verified"] for entry in failing.received) and len(failing.received) == event.attempts
        assert 1.6 <= waits[0] <= 2.4 and 3.2 <= waits[1] <= 4.8  # exponential, jittered
        assert max(waits) <= delivery.MAX_RETRY_S * 1.2
        assert clock.now - event.created_at >= timedelta(hours=24)
        assert 20 <= event.attempts <= 60
    finally:
        deliverer.close()
        failing.stop()


def test_a_receiver_dripping_its_answer_holds_a_worker_no_longer_than_the_attempts_timeout(store, monkeypatch):
    """Found in issue 28's leftovers: httpx's timeouts are per read and write, so a receiver sending its
    answer a byte every 0.2 s (far inside the 5 s read timeout) held a delivery worker, and the connection,
    for as long as it kept dripping. An attempt now ends at BATCH_PIPELINE_WEBHOOK_ATTEMPT_TIMEOUT_S, its
    connection closed, failed, and is retried with the backoff."""
    monkeypatch.setenv("ALPHA_SECRET", ALPHA_SECRET)
    dripping = Receiver(ALPHA_SECRET, mode="drip")
    clock = Clock()
    endpoint = WebhookConfig(url=dripping.url, secret_env="ALPHA_SECRET")
    outbox = WebhookOutbox(engine=store.engine)
    deliverer = Deliverer(
        outbox, endpoints=lambda owner: [endpoint], clock=clock, attempt_timeout_s=1.5, **_LOOPBACK_ALLOWED
    )
    try:
        job, _ = store.create(_new_job("team:alpha"))
        store.cancel_before_launch(job.job_id)
        clock.now = datetime.now(UTC)
        started = time.monotonic()
        [attempt] = deliverer.tick()
        attempt.result(timeout=20)
        assert 1.5 <= time.monotonic() - started < 8
        assert dripping.cut_off.wait(5), "the dripping connection was left open"
        [event] = _events(store, job.job_id)
        assert (event.state, event.attempts, event.last_error) == ("pending", 1, "webhooks[0]: timed out")
        assert 1.6 <= (event.next_attempt_at - clock.now).total_seconds() <= 2.4  # the first backoff
        assert [entry["verified"] for entry in dripping.received] == [True]

        dripping.mode = "ok"  # the receiver mended: the retry, once due, is taken
        assert deliverer.tick() == []
        clock.now = event.next_attempt_at
        _deliver_all(deliverer)
        assert [(e.state, e.attempts) for e in _events(store, job.job_id)] == [("delivered", 2)]
    finally:
        dripping.stop()  # first: before the fix, the attempt ends only when the drip does
        deliverer.close()


def test_a_redirect_is_not_followed_and_an_event_goes_to_its_teams_endpoints_only(store, monkeypatch):
    monkeypatch.setenv("ALPHA_SECRET", ALPHA_SECRET)
    monkeypatch.setenv("BETA_SECRET", BETA_SECRET)
    alpha, beta = Receiver(ALPHA_SECRET), Receiver(BETA_SECRET)

    class Redirect(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.send_response(307)
            self.send_header("location", alpha.url)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    redirecting = ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=redirecting.serve_forever, daemon=True).start()
    endpoints = {
        "team:alpha": [WebhookConfig(url=alpha.url, secret_env="ALPHA_SECRET")],
        "team:beta": [
            WebhookConfig(url=beta.url, secret_env="BETA_SECRET"),
            WebhookConfig(
                url=f"http://127.0.0.1:{redirecting.server_address[1]}/",
                secret_env="BETA_SECRET",
                events=["job.failed"],
            ),
        ],
    }
    deliverer = Deliverer(
        WebhookOutbox(engine=store.engine), endpoints=lambda owner: endpoints.get(owner, []), **_LOOPBACK_ALLOWED
    )
    try:
        ids = {}
        for owner in ("team:alpha", "team:beta", "admins"):
            job, _ = store.create(_new_job(owner))
            store.mark_failed(job.job_id, "boom")
            ids[owner] = job.job_id
        _deliver_all(deliverer)
        assert [p["data"]["job_id"] for p in alpha.verified_payloads()] == [ids["team:alpha"]]
        assert [p["data"]["job_id"] for p in beta.verified_payloads()] == [ids["team:beta"]]
        [beta_event] = _events(store, ids["team:beta"])
        assert (
            beta_event.state == "pending"
            and beta_event.last_error == "webhooks[1]: HTTP 307 (redirects are not followed)"
        )
        assert len(beta_event.delivered_to) == 1  # the first endpoint is not sent it again
        assert [e.state for e in _events(store, ids["admins"])] == ["unsubscribed"]
        assert [e.state for e in _events(store, ids["team:alpha"])] == ["delivered"]
    finally:
        deliverer.close()
        redirecting.shutdown()
        redirecting.server_close()
        alpha.stop()
        beta.stop()


class _TeamsDNS:
    """A test double for DNS servers a team controls (none can run here): each name of `answers` resolves
    to its addresses in turn, one a lookup, the last again ever after, as a rebinding server answers; every
    other name as the system resolves it."""

    def __init__(self, monkeypatch, answers: dict[str, list[str]]) -> None:
        self.lookups: dict[str, int] = {}
        system = socket.getaddrinfo

        def getaddrinfo(host, port, *args, **kwargs):
            host = host.decode() if isinstance(host, bytes) else host
            if host not in answers:
                return system(host, port, *args, **kwargs)
            count = self.lookups[host] = self.lookups.get(host, 0) + 1
            return system(answers[host][min(count, len(answers[host])) - 1], port, *args, **kwargs)

        monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def test_an_endpoint_whose_host_points_at_a_non_public_address_is_not_sent_to_and_its_answer_never_read_back(
    store, monkeypatch
):
    """Found by an attacker review: delivery connected wherever an endpoint's host pointed. A team that
    owns its listed host's DNS pointed it at an internal service (here one answering 500 on loopback; a
    cloud's metadata address likewise) and read the service's answer back through `last_error`."""
    monkeypatch.setenv("ALPHA_SECRET", ALPHA_SECRET)
    internal = Receiver(ALPHA_SECRET, mode="500")
    urls = [
        f"http://localhost:{internal.port}/hook",
        f"http://127.0.0.1:{internal.port}/hook",
        f"http://[::ffff:127.0.0.1]:{internal.port}/hook",
        "http://169.254.169.254/latest/meta-data/",
    ]
    endpoints = [WebhookConfig(url=url, secret_env="ALPHA_SECRET") for url in urls]
    outbox = WebhookOutbox(engine=store.engine)
    deliverer = Deliverer(outbox, endpoints=lambda owner: endpoints)
    refused = (
        "refused: its host resolves to no public address (BATCH_PIPELINE_WEBHOOK_ALLOW_PRIVATE_NETWORKS names "
        "the private networks receivers may be in)"
    )
    try:
        job, _ = store.create(_new_job("team:alpha"))
        store.cancel_before_launch(job.job_id)
        _deliver_all(deliverer)
        [event] = _events(store, job.job_id)
        assert internal.received == []
        assert event.state == "pending" and event.last_error == "; ".join(
            f"webhooks[{index}]: {refused}" for index in range(len(urls))
        )
    finally:
        deliverer.close()
    # An operator whose receivers are on loopback allows it: those are sent to, the metadata address is not.
    allowing = Deliverer(
        outbox, endpoints=lambda owner: endpoints, allowed_networks=delivery.private_networks(LOOPBACK)
    )
    try:
        job, _ = store.create(_new_job("team:alpha"))
        store.cancel_before_launch(job.job_id)
        _deliver_all(allowing)
        [event] = _events(store, job.job_id)
        assert len(internal.received) == 3 and all(entry["verified"] for entry in internal.received)
        assert event.last_error == "; ".join(
            [*(f"webhooks[{i}]: HTTP 500" for i in range(3)), f"webhooks[3]: {refused}"]
        )
    finally:
        allowing.close()
        internal.stop()


def test_delivery_connects_to_the_address_it_checked_so_a_rebinding_dns_answer_reaches_nothing_internal(
    store, monkeypatch
):
    """Checked, then looked up again to connect, a host whose DNS answers a receiver's address once and an
    internal one after (DNS rebinding) would send the request inside: it goes to the address checked."""
    monkeypatch.setenv("ALPHA_SECRET", ALPHA_SECRET)
    receiver = Receiver(ALPHA_SECRET)
    internal = Receiver(ALPHA_SECRET, mode="500", port=receiver.port, host="127.0.0.2")
    dns = _TeamsDNS(monkeypatch, {"rebinding.test": ["127.0.0.1", "127.0.0.2"]})
    endpoint = WebhookConfig(url=f"http://rebinding.test:{receiver.port}/hook", secret_env="ALPHA_SECRET")
    deliverer = Deliverer(
        WebhookOutbox(engine=store.engine),
        endpoints=lambda owner: [endpoint],
        allowed_networks=delivery.private_networks("127.0.0.1/32"),  # the receiver's, and no other
    )
    try:
        job, _ = store.create(_new_job("team:alpha"))
        store.cancel_before_launch(job.job_id)
        _deliver_all(deliverer)
        assert internal.received == [] and dns.lookups == {"rebinding.test": 1}
        assert [entry["headers"]["host"] for entry in receiver.received] == [f"rebinding.test:{receiver.port}"]
        assert [e.state for e in _events(store, job.job_id)] == ["delivered"]
    finally:
        deliverer.close()
        receiver.stop()
        internal.stop()


def _certificate(name: str) -> tuple[bytes, bytes]:
    """A self-signed certificate for the DNS name `name`, and its key, in PEM."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.now(UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return certificate.public_bytes(serialization.Encoding.PEM), key_pem


def test_an_https_endpoint_reached_at_its_checked_address_is_still_verified_against_its_host_name(
    store, monkeypatch, tmp_path
):
    """Connecting to the address checked must not weaken TLS: the certificate is checked against the URL's
    host name (sent as SNI), so a receiver holding another name's certificate is refused."""
    monkeypatch.setenv("ALPHA_SECRET", ALPHA_SECRET)
    certificate, key = _certificate("hooks.test")
    (tmp_path / "cert.pem").write_bytes(certificate)
    (tmp_path / "key.pem").write_bytes(key)
    serving = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    serving.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    receiver = Receiver(ALPHA_SECRET, tls=serving)
    _TeamsDNS(monkeypatch, {"hooks.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]})
    endpoints = [
        WebhookConfig(url=f"https://{name}:{receiver.port}/hook", secret_env="ALPHA_SECRET")
        for name in ("hooks.test", "other.test")
    ]
    deliverer = Deliverer(
        WebhookOutbox(engine=store.engine),
        endpoints=lambda owner: endpoints,
        allowed_networks=delivery.private_networks(LOOPBACK),
        tls=ssl.create_default_context(cadata=certificate.decode()),
    )
    try:
        job, _ = store.create(_new_job("team:alpha"))
        store.cancel_before_launch(job.job_id)
        _deliver_all(deliverer)
        assert [entry["headers"]["host"] for entry in receiver.received] == [f"hooks.test:{receiver.port}"]
        assert receiver.verified_payloads()[0]["data"]["job_id"] == job.job_id
        [event] = _events(store, job.job_id)
        assert event.state == "pending" and event.last_error == "webhooks[1]: connection failed"
        assert len(event.delivered_to) == 1
    finally:
        deliverer.close()
        receiver.stop()


def test_a_forged_or_replayed_or_other_teams_signature_is_rejected_by_the_verifier():
    secret = Webhook(ALPHA_SECRET)
    now = datetime.now(UTC)
    body = '{"type":"job.completed","data":{"job_id":"batch-1"}}'
    headers = delivery.signed_headers(secret, "evt_1", body, now)
    assert secret.verify(body, headers)["data"]["job_id"] == "batch-1"
    with pytest.raises(WebhookVerificationError):  # another body under the same signature
        secret.verify(body.replace("batch-1", "batch-2"), headers)
    with pytest.raises(WebhookVerificationError):  # signed with another team's secret
        secret.verify(body, delivery.signed_headers(Webhook(BETA_SECRET), "evt_1", body, now))
    with pytest.raises(WebhookVerificationError):  # a replay of an old delivery
        secret.verify(body, delivery.signed_headers(secret, "evt_1", body, now - timedelta(hours=1)))
    with pytest.raises(WebhookVerificationError):
        secret.verify(body, headers | {"webhook-id": "evt_2"})


# --- through serve: the real deployment ----------------------------------------------------------------------


@pytest.mark.slow
def test_through_serve_each_event_reaches_its_team_once_up_signed_and_a_hanging_or_500_receiver_delays_no_job(
    tmp_path, monkeypatch
):
    """The real deployment (`serve`: API, Dagster daemon, webhook process; one run slot). Team alpha's
    receiver is down when its first event (a batch whose input did not validate: batch.failed) is sent, and
    comes up once the outbox shows the failed attempt; it then gets that event, a cancelled job's and a real
    job's job.completed, each verified by the standardwebhooks library, and never another team's. Team beta's
    endpoints hang and answer 500: its event stays pending, retried, while alpha's real job runs and ends."""
    import httpx

    from tests.entrypoints.test_serve import Served
    from tests.openai_batch.test_openai_batch import _create, _jsonl, _line, _upload

    monkeypatch.delenv("BATCH_PIPELINE_JOBS_DB", raising=False)
    monkeypatch.delenv("BATCH_PIPELINE_WORK_DIR", raising=False)
    roots = {name: tmp_path / name for name in ("alpha", "beta")}
    for root in roots.values():
        root.mkdir()
    alpha_port = _free_port()
    hanging, failing = Receiver(BETA_SECRET, mode="hang"), Receiver(BETA_SECRET, mode="500")
    tenants_file = tmp_path / "tenants.yaml"
    tenants_file.write_text(
        "tenants:\n"
        "  alpha:\n"
        f"    api_keys_sha256: [{_digest(ALPHA)}]\n"
        f"    data_roots: [{roots['alpha']}]\n"
        f"    webhooks: [{{url: 'http://127.0.0.1:{alpha_port}/hook', secret_env: ALPHA_SECRET}}]\n"
        "  beta:\n"
        f"    api_keys_sha256: [{_digest(BETA)}]\n"
        f"    data_roots: [{roots['beta']}]\n"
        "    webhooks:\n"
        f"      - {{url: '{hanging.url}', secret_env: BETA_SECRET}}\n"
        f"      - {{url: '{failing.url}', secret_env: BETA_SECRET, events: [batch.failed]}}\n"
        "admins:\n"
        f"  api_keys_sha256: [{_digest('admin-key')}]\n"
    )
    served = Served(
        tmp_path,
        env={
            "BATCH_PIPELINE_TENANTS": str(tenants_file),
            "ALPHA_SECRET": ALPHA_SECRET,
            "BETA_SECRET": BETA_SECRET,
            "BATCH_PIPELINE_WEBHOOK_ALLOW_PRIVATE_NETWORKS": LOOPBACK,
        },
    )
    alpha = None
    try:
        served.wait_until_up()
        api = httpx.Client(base_url=served.api, timeout=30)
        deadline = time.monotonic() + 900

        def webhooks(job_id: str, key: str = ALPHA) -> httpx.Response:
            return api.get(f"/v2/batch-completions/{job_id}/webhooks", headers={"x-api-key": key})

        def wait_until(predicate, what: str):
            while not (value := predicate()):
                assert time.monotonic() < deadline, f"{what}\n{served.log.read_text()[-3000:]}"
                time.sleep(0.3)
            return value

        def invalid_batch(key: str) -> str:
            uploaded = _upload(api, _jsonl([_line("a", temperature=9)]), key=key)
            assert uploaded.status_code == 200, uploaded.text
            created = _create(api, uploaded.json()["id"], key=key)
            assert created.status_code == 200 and created.json()["status"] == "failed", created.text
            return created.json()["id"]

        # Beta's event first: its receivers hang and answer 500, for as long as this test runs.
        beta_batch = invalid_batch(BETA)
        wait_until(lambda: hanging.received and failing.received, "beta's endpoints were sent its event")

        # Alpha's receiver is down: the first attempt fails, visibly, to alpha alone.
        alpha_batch = invalid_batch(ALPHA)
        assert webhooks(alpha_batch, BETA).status_code == 404  # another team's job: absent
        first = wait_until(
            lambda: [e for e in webhooks(alpha_batch).json()["events"] if e["attempts"] >= 1 and e["last_error"]],
            "alpha's first attempt failed",
        )[0]
        assert first["type"] == "batch.failed" and first["state"] == "pending"
        assert first["last_error"] == "webhooks[0]: connection failed"

        # A real job of alpha runs to its end while beta's receivers hang; a queued one is cancelled.
        body = {
            "output_data_path": str(roots["alpha"] / "out.json"),
            "model_config": {"model": MODEL},
            "content": {"prompts": ["The capital of France is"], "max_new_tokens": 4, "temperature": 0},
        }
        ran = api.post("/v2/batch-completions", json=body, headers={"x-api-key": ALPHA}).json()["job_id"]
        queued = api.post(
            "/v2/batch-completions", json=body | {"output_data_path": str(roots["alpha"] / "2.json")},
            headers={"x-api-key": ALPHA},
        ).json()["job_id"]  # fmt: skip
        cancelled = api.post(f"/v2/batch-completions/{queued}/actions/cancel", headers={"x-api-key": ALPHA})
        assert cancelled.status_code == 200, cancelled.text

        alpha = Receiver(ALPHA_SECRET, port=alpha_port)  # the down period ends
        wait_until(
            lambda: (
                api.get(f"/v2/batch-completions/{ran}", headers={"x-api-key": ALPHA}).json()["job"]["status"]
                not in ("queued", "running")
            ),
            "alpha's job ended",
        )
        assert (
            api.get(f"/v2/batch-completions/{ran}", headers={"x-api-key": ALPHA}).json()["job"]["status"] == "completed"
        )
        wait_until(lambda: len(alpha.verified_payloads()) >= 3, "alpha's three events arrived")
        wait_until(
            lambda: all(webhooks(j).json()["events"][0]["state"] == "delivered" for j in (alpha_batch, ran, queued)),
            "alpha's events read delivered",
        )
        got = {}
        for payload in alpha.verified_payloads():
            key = payload["data"].get("job_id") or payload["data"]["id"]
            got.setdefault(key, set()).add(payload["type"])
        assert got == {alpha_batch: {"batch.failed"}, ran: {"job.completed"}, queued: {"job.cancelled"}}
        assert all(entry["verified"] for entry in alpha.received)  # every delivery verified
        [batch_event] = [e for e in alpha.verified_payloads() if e["type"] == "batch.failed"]
        assert batch_event["object"] == "event" and batch_event["id"].startswith("evt_")
        assert batch_event["id"] == webhooks(alpha_batch).json()["events"][0]["id"]

        # A forged delivery (the body changed, or signed with beta's secret) is rejected by alpha's verifier.
        # The batch's delivery (the order of a team's deliveries is not fixed): its body names the batch.
        [entry] = [entry for entry in alpha.received if alpha_batch.encode() in entry["body"]][:1]
        forged = entry["body"].replace(alpha_batch.encode(), beta_batch.encode())
        assert forged != entry["body"]
        with pytest.raises(WebhookVerificationError):
            alpha.verifier.verify(forged, entry["headers"])
        resigned = delivery.signed_headers(Webhook(BETA_SECRET), entry["headers"]["webhook-id"], forged.decode(),
                                           datetime.now(UTC))  # fmt: skip
        with pytest.raises(WebhookVerificationError):
            alpha.verifier.verify(forged, resigned)

        # Beta's event: pending, retried, never delivered; beta's receivers saw beta's event only.
        [beta_event] = webhooks(beta_batch, BETA).json()["events"]
        assert beta_event["state"] == "pending" and beta_event["attempts"] >= 1
        assert (
            "webhooks[1]: HTTP 500" in beta_event["last_error"] or "webhooks[0]: timed out" in beta_event["last_error"]
        )
        for receiver in (hanging, failing):
            assert {p["data"]["id"] for p in receiver.verified_payloads()} == {beta_batch}

        # Figures for Prometheus; and no secret anywhere it could be read.
        metrics = api.get("/metrics", headers={"x-api-key": "admin-key"}).text
        assert 'batch_pipeline_webhook_delivered_total{team="alpha",type="job.completed"} 1.0' in metrics
        assert 'batch_pipeline_webhook_pending{team="beta",type="batch.failed"} 1.0' in metrics
        shown = served.log.read_text() + metrics + webhooks(ran).text + webhooks(beta_batch, BETA).text
        for secret in (ALPHA_SECRET, BETA_SECRET):
            assert secret not in shown and secret.removeprefix("whsec_") not in shown
        assert alpha.url not in shown and hanging.url not in shown
    finally:
        served.kill()
        for receiver in (alpha, hanging, failing):
            if receiver is not None:
                receiver.stop()


# --- what a team reads back: its own events only ----------------------------------------------------------------


@pytest.fixture
def two_teams(tmp_path, monkeypatch):
    roots = {name: tmp_path / name for name in ("alpha", "beta")}
    for root in roots.values():
        root.mkdir()
    tenants_file = tmp_path / "tenants.yaml"
    tenants_file.write_text(
        "tenants:\n"
        "  alpha:\n"
        f"    api_keys_sha256: [{_digest(ALPHA)}]\n"
        f"    data_roots: [{roots['alpha']}]\n"
        "    webhooks: [{url: 'https://alpha.example/hook?token=t0ps3cret', secret_env: ALPHA_SECRET}]\n"
        "  beta:\n"
        f"    api_keys_sha256: [{_digest(BETA)}]\n"
        f"    data_roots: [{roots['beta']}]\n"
        "admins:\n"
        f"  api_keys_sha256: [{_digest('admin-key')}]\n"
    )
    monkeypatch.setenv("BATCH_PIPELINE_TENANTS", str(tenants_file))
    monkeypatch.setenv("ALPHA_SECRET", ALPHA_SECRET)
    return roots


def test_a_jobs_webhook_states_are_read_by_its_team_and_admins_only_and_counted_for_prometheus(two_teams, tenants_api):
    from tests.openai_batch.test_openai_batch import _create, _jsonl, _line, _upload

    uploaded = _upload(tenants_api, _jsonl([_line("a", temperature=9)]), key=ALPHA)
    batch = _create(tenants_api, uploaded.json()["id"], key=ALPHA).json()
    assert batch["status"] == "failed"
    route = f"/v2/batch-completions/{batch['id']}/webhooks"
    own = tenants_api.get(route, headers={"x-api-key": ALPHA})
    assert own.status_code == 200, own.text
    [event] = own.json()["events"]
    assert event["type"] == "batch.failed" and event["state"] == "pending" and event["attempts"] == 0
    assert tenants_api.get(route, headers={"x-api-key": BETA}).status_code == 404  # absent to another team
    assert tenants_api.get(route, headers={"x-api-key": "admin-key"}).json() == own.json()
    assert tenants_api.get("/v2/batch-completions/batch-nope/webhooks", headers={"x-api-key": ALPHA}).status_code == 404
    metrics = tenants_api.get("/metrics", headers={"x-api-key": "admin-key"}).text
    assert 'batch_pipeline_webhook_events_total{team="alpha",type="batch.failed"} 1.0' in metrics
    assert 'batch_pipeline_webhook_pending{team="alpha",type="batch.failed"} 1.0' in metrics
    for text in (own.text, metrics):
        assert "t0ps3cret" not in text and ALPHA_SECRET not in text and "alpha.example" not in text
