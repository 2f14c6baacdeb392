"""A team's quotas from the tenants file, through the real app: `max_stored_bytes` (its OpenAI files plus
its jobs' inline content) and `max_tokens_per_day` (its jobs' prompt and completion tokens of the UTC day).
A submission past one is a 429 naming the quota and its figures, in OpenAI's shape on /v1/files and
/v1/batches, with Retry-After where waiting helps, and nothing is stored: no row, no file."""

import contextlib
import hashlib
import json
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from tempfile import SpooledTemporaryFile

import anyio
import dagster as dg
import httpx
import pytest
import sqlalchemy as sa
import uvicorn

from batch_pipeline.admission.policy import AdmissionPolicy
from batch_pipeline.admission.submission import QuotaExceeded, check_tokens_quota, hold_stored_bytes
from batch_pipeline.core.settings import settings
from batch_pipeline.store.jobs import JobStore
from batch_pipeline.store.openai import files
from batch_pipeline.store.quotas import QuotaStore
from batch_pipeline.store.schema import JobStatus, jobs
from tests.conftest import MODEL
from tests.openai_batch.test_openai_batch import _create, _jsonl, _line, _upload

SMALL, OTHER = "key-of-the-small-team", "key-of-the-other-team"
STORED_MAX, TOKENS_MAX = 1000, 100


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture
def teams(tmp_path, monkeypatch):
    roots = {name: tmp_path / name for name in ("small", "roomy")}
    for root in roots.values():
        root.mkdir()
    tenants_file = tmp_path / "tenants.yaml"
    tenants_file.write_text(
        "tenants:\n"
        "  small:\n"
        f"    api_keys_sha256: [{_digest(SMALL)}]\n"
        f"    data_roots: [{roots['small']}]\n"
        f"    max_stored_bytes: {STORED_MAX}\n"
        f"    max_tokens_per_day: {TOKENS_MAX}\n"
        "  roomy:\n"
        f"    api_keys_sha256: [{_digest(OTHER)}]\n"
        f"    data_roots: [{roots['roomy']}]\n"
    )
    monkeypatch.setenv("BATCH_PIPELINE_TENANTS", str(tenants_file))
    return roots


@pytest.fixture
def api(teams, tenants_api):
    return tenants_api


def _body(output, content: dict | None = None) -> dict:
    return {
        "output_data_path": str(output),
        "model_config": {"model": MODEL},
        "content": content or {"prompts": ["hi"], "max_new_tokens": 4, "temperature": 0},
    }


def _submit(api, key: str, output, version: str = "v2", idempotency_key: str | None = None, **body):
    path = "/v2/batch-completions" if version == "v2" else "/v1/llm/batch-completions"
    headers = {"x-api-key": key} | ({"Idempotency-Key": idempotency_key} if idempotency_key else {})
    return api.post(path, json=_body(output, **body), headers=headers)


def _job_ids(api, key: str) -> list[str]:
    return [job["job_id"] for job in api.get("/v2/batch-completions", headers={"x-api-key": key}).json()["jobs"]]


def _file_ids(api, key: str) -> list[str]:
    return [file["id"] for file in api.get("/v1/files", headers={"Authorization": f"Bearer {key}"}).json()["data"]]


def _home(tmp_path):
    return tmp_path / "dagster_home"


def _on_disk(tmp_path) -> dict[str, list[str]]:
    """What the service keeps on disk: the files dir's files and the job work dirs."""
    work = _home(tmp_path) / "work"
    files_dir = work / "files"
    return {
        "files": sorted(path.name for path in files_dir.iterdir()) if files_dir.exists() else [],
        "work": sorted(path.name for path in work.iterdir() if path.name != "files") if work.exists() else [],
    }


def _file_rows() -> int:
    with JobStore(settings().job_store_url).engine.connect() as connection:
        return connection.execute(sa.select(sa.func.count()).select_from(files)).scalar_one()


def _openai_error(response, quota: str) -> dict:
    assert response.status_code == 429, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "rate_limit_exceeded"
    assert error["message"].startswith(f"{quota}:"), error
    return error


# --- max_stored_bytes -----------------------------------------------------------------------------------


def test_an_upload_past_max_stored_bytes_gets_openais_429_and_nothing_is_kept(api, tmp_path):
    data = _jsonl([_line("a", content="x" * 400)])
    assert 2 * len(data) > STORED_MAX >= len(data)
    first = _upload(api, data, key=SMALL)
    assert first.status_code == 200, first.text
    kept = _on_disk(tmp_path)
    assert len(kept["files"]) == 1

    refused = _upload(api, data, key=SMALL)
    error = _openai_error(refused, "max_stored_bytes")
    assert f"stores {len(data)} bytes" in error["message"] and f"quota of {STORED_MAX}" in error["message"]
    assert f"this upload of {len(data)} bytes" in error["message"] and "DELETE /v1/files" in error["message"]
    assert "retry-after" not in refused.headers  # waiting frees nothing
    assert _file_ids(api, SMALL) == [first.json()["id"]] and _file_rows() == 1
    assert _on_disk(tmp_path) == kept

    # Another team's bytes are its own; a deleted file no longer counts.
    assert _upload(api, data, key=OTHER).status_code == 200
    deleted = api.delete(f"/v1/files/{first.json()['id']}", headers={"Authorization": f"Bearer {SMALL}"})
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert _upload(api, data, key=SMALL).status_code == 200


@pytest.fixture
def spooled(monkeypatch) -> list[int]:
    """The sizes of what is written to spooled temporary files (starlette's parser spools uploads in them)."""
    written: list[int] = []
    real_write = SpooledTemporaryFile.write

    def counting_write(self, data):
        written.append(len(data))
        return real_write(self, data)

    monkeypatch.setattr(SpooledTemporaryFile, "write", counting_write)
    return written


def test_an_upload_known_too_large_by_its_length_is_never_spooled(api, tmp_path, spooled):
    """Declared past the team's room (plus the multipart margin BodySizeLimit allows): dropped as it
    arrives, none of it spooled, then answered 429."""
    data = b'{"custom_id": "a"}\n' * 10_000  # 190 kB against a 1000-byte quota
    refused = _upload(api, data, key=SMALL)
    error = _openai_error(refused, "max_stored_bytes")
    assert "this upload of at least " in error["message"] and "retry-after" not in refused.headers
    assert spooled == []  # none of it was spooled
    assert _file_rows() == 0 and _on_disk(tmp_path)["files"] == []


def test_a_streamed_upload_past_the_quota_is_never_spooled_whole(api, tmp_path, spooled):
    """A body without a length (chunked) is counted as it arrives and, once past the team's room plus the
    margin, read to its end and dropped, then answered 429: a 10 MiB upload against a 1000-byte quota is
    never spooled in full (the parser has seen two chunks)."""
    chunk, chunks = 64 * 1024, 160
    head = b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    head += b'--B\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
    pulled, sent = 0, []

    async def receive():
        nonlocal pulled
        if pulled == chunks:
            return {"type": "http.request", "body": b"\r\n--B--\r\n", "more_body": False}
        pulled += 1
        body = (head if pulled == 1 else b"") + b"x" * chunk
        return {"type": "http.request", "body": body, "more_body": True}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/files",
        "raw_path": b"/v1/files",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"testserver"),
            (b"authorization", f"Bearer {SMALL}".encode()),
            (b"content-type", b"multipart/form-data; boundary=B"),
            (b"transfer-encoding", b"chunked"),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
        "state": {},
    }
    anyio.run(api.app, scope, receive, send)
    start = next(message for message in sent if message["type"] == "http.response.start")
    assert start["status"] == 429
    body = json.loads(b"".join(message.get("body", b"") for message in sent if message["type"] == "http.response.body"))
    assert body["error"]["message"].startswith("max_stored_bytes:") and "at least" in body["error"]["message"]
    assert pulled == chunks  # read to its end, so that the client reads the answer
    assert 0 < sum(spooled) <= 2 * chunk, spooled  # the room (1000 B) and the margin (64 KiB): two chunks
    assert _file_rows() == 0 and _on_disk(tmp_path)["files"] == []


def test_inline_content_counts_and_past_the_quota_is_a_429_storing_nothing(api, teams, tmp_path):
    made = _submit(api, SMALL, teams["small"] / "1.json", idempotency_key="first")
    assert made.status_code == 200, made.text
    job_id = made.json()["job_id"]
    record = JobStore(settings().job_store_url).get(job_id)
    assert record.content_bytes == os.path.getsize(record.content_path) > 0  # recorded on the job's row
    kept, jobs_before = _on_disk(tmp_path), _job_ids(api, SMALL)

    big = {"prompts": ["x" * STORED_MAX], "max_new_tokens": 4, "temperature": 0}
    for version in ("v2", "v1"):
        refused = _submit(api, SMALL, teams["small"] / "2.json", version=version, content=big)
        assert refused.status_code == 429, refused.text
        detail = refused.json()["detail"]
        assert detail.startswith("max_stored_bytes:") and f"stores {record.content_bytes} bytes" in detail
        assert f"quota of {STORED_MAX}" in detail and "this request's inline content of" in detail
        assert "retry-after" not in refused.headers
    assert _job_ids(api, SMALL) == jobs_before and _on_disk(tmp_path) == kept

    # The content's bytes count against uploads too: a file that would fit alone does not fit now.
    data = _jsonl([_line("a", content="x" * (STORED_MAX - 200))])
    assert len(data) <= STORED_MAX < len(data) + record.content_bytes
    _openai_error(_upload(api, data, key=SMALL), "max_stored_bytes")
    # A retry of the submission that made its job is answered with that job, whatever the quota says now.
    retried = _submit(api, SMALL, teams["small"] / "1.json", idempotency_key="first")
    assert retried.status_code == 200 and retried.json()["job_id"] == job_id
    # A request naming its input by path stores nothing of the team's: it is not refused.
    (teams["small"] / "in.json").write_text(json.dumps([{"prompt": "x" * STORED_MAX}]))
    by_path = _body(teams["small"] / "3.json") | {"input_data_path": str(teams["small"] / "in.json")}
    del by_path["content"]
    assert api.post("/v2/batch-completions", json=by_path, headers={"x-api-key": SMALL}).status_code == 200


def test_bytes_being_stored_at_once_are_counted_against_each_other(api, tmp_path):
    """Two uploads racing: while one is being copied (its bytes held, its row not yet stored), the other
    is checked against it too, so together they cannot pass the quota."""
    data = _jsonl([_line("a", content="x" * 400)])
    small = AdmissionPolicy.of_deployment(settings()).team_of_owner("team:small")  # the API's teams
    with hold_stored_bytes(JobStore(settings().job_store_url), "team:small", small, len(data), "an upload in progress"):
        _openai_error(_upload(api, data, key=SMALL), "max_stored_bytes")
        assert _upload(api, data, key=OTHER).status_code == 200  # another team's room is its own
    assert _upload(api, data, key=SMALL).status_code == 200  # held bytes are let go once stored or dropped
    assert _file_rows() == 2 and len(_on_disk(tmp_path)["files"]) == 2


# --- max_tokens_per_day ---------------------------------------------------------------------------------


def _ran(job_id: str, tokens: int, started_at: datetime, completed_at: datetime | None) -> None:
    """The job's row as the pipeline leaves it: started, maybe ended, with its tokens."""
    values = {
        "status": JobStatus.COMPLETED if completed_at else JobStatus.RUNNING,
        "started_at": started_at,
        "completed_at": completed_at,
        "prompt_tokens": tokens // 2,
        "completion_tokens": tokens - tokens // 2,
    }
    with JobStore(settings().job_store_url).engine.begin() as connection:
        connection.execute(jobs.update().where(jobs.c.job_id == job_id).values(**values))


def _seconds_to_midnight() -> float:
    now = datetime.now(UTC)
    return (now.replace(hour=0, minute=0, second=0, microsecond=0) + timedelta(days=1) - now).total_seconds()


def _estimate(job_id: str) -> int:
    with JobStore(settings().job_store_url).engine.connect() as connection:
        return connection.execute(sa.select(jobs.c.estimated_tokens).where(jobs.c.job_id == job_id)).scalar_one()


def test_the_tokens_quota_counts_today_utc_and_the_teams_own_only_and_refuses_every_way_in(api, teams, tmp_path):
    now = datetime.now(UTC)
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    small = [_submit(api, SMALL, teams["small"] / f"{i}.json").json()["job_id"] for i in range(3)]
    other = _submit(api, OTHER, teams["roomy"] / "1.json").json()["job_id"]
    # Each job reserves its estimate from its submission: "hi" (one token at 4 characters a token, plus one)
    # and its 4 new tokens.
    estimate = _estimate(small[0])
    assert estimate == 5 and _estimate(other) is None  # the other team has no tokens quota to reserve against
    # Yesterday's tokens (a job that ended a second before midnight) and another team's today don't count.
    _ran(small[0], 10 * TOKENS_MAX, midnight - timedelta(hours=2), midnight - timedelta(seconds=1))
    _ran(other, 10 * TOKENS_MAX, now, now)
    # Ended today: counts what it used, all of it, its estimate no more; with the waiting job's estimate, one
    # token below the quota.
    _ran(small[1], TOKENS_MAX - 1 - estimate, midnight - timedelta(hours=1), now)
    made = _submit(api, SMALL, teams["small"] / "a.json")
    assert made.status_code == 200, made.text
    # A job still running counts the larger of its estimate and what it has used so far; the team, with the
    # job just made, has passed its quota.
    _ran(small[2], 3, now, None)
    used, reserved = TOKENS_MAX - 1 - estimate + 3, (estimate - 3) + estimate
    kept, jobs_before = _on_disk(tmp_path), _job_ids(api, SMALL)

    for version in ("v2", "v1"):
        refused = _submit(api, SMALL, teams["small"] / "b.json", version=version)
        assert refused.status_code == 429, refused.text
        detail = refused.json()["detail"]
        assert detail.startswith(f"max_tokens_per_day: your team's jobs have used {used}/{TOKENS_MAX} tokens"), detail
        assert f"hold {reserved} more by their estimates ({used + reserved}/{TOKENS_MAX})" in detail, detail
        assert abs(int(refused.headers["retry-after"]) - _seconds_to_midnight()) <= 5  # the next UTC midnight
    uploaded = _upload(api, _jsonl([_line("a")]), key=SMALL)  # files are not tokens: kept
    assert uploaded.status_code == 200
    batch = _create(api, uploaded.json()["id"], key=SMALL)
    error = _openai_error(batch, "max_tokens_per_day")
    assert f"({used + reserved}/{TOKENS_MAX})" in error["message"]
    assert abs(int(batch.headers["retry-after"]) - _seconds_to_midnight()) <= 5
    assert api.get("/v1/batches", headers={"Authorization": f"Bearer {SMALL}"}).json()["data"] == []
    assert _job_ids(api, SMALL) == jobs_before and _on_disk(tmp_path)["work"] == kept["work"]
    # The other team, with no such quota, submits as before.
    assert _submit(api, OTHER, teams["roomy"] / "2.json").status_code == 200
    # A job that ends gives back what its estimate held beyond what it used: the team is below its quota again.
    cancelled = api.post(f"/v2/batch-completions/{made.json()['job_id']}/actions/cancel", headers={"x-api-key": SMALL})
    assert cancelled.status_code == 200 and cancelled.json()["success"] is True
    assert _submit(api, SMALL, teams["small"] / "c.json").status_code == 200


def test_the_day_of_the_tokens_quota_is_the_utc_day(api, teams):
    """Retry-After counts to the next UTC midnight, whatever the caller's zone; past it the count restarts."""
    store = JobStore(settings().job_store_url)
    job_id = _submit(api, SMALL, teams["small"] / "1.json").json()["job_id"]
    day = datetime(2030, 5, 1, tzinfo=UTC)
    _ran(job_id, TOKENS_MAX, day + timedelta(hours=9), day + timedelta(hours=10))
    late = datetime(2030, 5, 1, 22, 59, 30, tzinfo=UTC)
    teams = AdmissionPolicy.of_deployment(settings()).teams()  # the API's
    assert teams is not None
    small, other = teams.team_of_owner("team:small"), teams.team_of_owner("team:roomy")
    with pytest.raises(QuotaExceeded) as refused:
        check_tokens_quota(store, "team:small", small, now=late.astimezone(datetime.now().astimezone().tzinfo))
    assert refused.value.quota == "max_tokens_per_day" and refused.value.retry_after_s == math.ceil(3600 + 30)
    check_tokens_quota(store, "team:small", small, now=day + timedelta(days=1, seconds=1))  # a new day: not refused
    check_tokens_quota(store, "team:roomy", other, now=late)  # no quota


# --- through a real deployment --------------------------------------------------------------------------


@pytest.mark.slow
def test_through_serve_a_team_past_its_tokens_of_the_day_after_one_real_job_gets_429(teams, tmp_path, monkeypatch):
    """Through the real deployment (one run slot), each quota answers 429 and stores nothing: an upload past
    `max_stored_bytes` (no file listed, none on disk), a job past `max_queued_jobs` while the slot is held
    (no job row), and, once one real job has used its tokens, a job past `max_tokens_per_day`."""
    import httpx

    from tests.entrypoints.test_serve import Served

    monkeypatch.delenv("BATCH_PIPELINE_JOBS_DB", raising=False)
    monkeypatch.delenv("BATCH_PIPELINE_WORK_DIR", raising=False)  # the files dir is DAGSTER_HOME/work/files
    tenants_file = tmp_path / "tenants-serve.yaml"  # a tokens quota any one job reaches
    tenants_file.write_text(
        "tenants:\n"
        "  small:\n"
        f"    api_keys_sha256: [{_digest(SMALL)}]\n"
        f"    data_roots: [{teams['small']}]\n"
        "    max_tokens_per_day: 1\n"
        f"    max_stored_bytes: {STORED_MAX}\n"
        "  roomy:\n"
        f"    api_keys_sha256: [{_digest(OTHER)}]\n"
        f"    data_roots: [{teams['roomy']}]\n"
        "    max_queued_jobs: 1\n"
    )
    served = Served(tmp_path, env={"BATCH_PIPELINE_TENANTS": str(tenants_file)})
    try:
        served.wait_until_up()
        api = httpx.Client(base_url=served.api, timeout=30)

        def submit(key: str, output) -> httpx.Response:
            return api.post("/v2/batch-completions", json=_body(output), headers={"x-api-key": key})

        def job(job_id: str, key: str = SMALL) -> dict:
            return api.get(f"/v2/batch-completions/{job_id}", headers={"x-api-key": key}).json()["job"]

        # max_stored_bytes: one upload fits, the next would pass the quota: OpenAI's 429, no file kept.
        data = _jsonl([_line("a", content="x" * 400)])
        assert 2 * len(data) > STORED_MAX >= len(data) + 200  # room for the job's inline content below
        first_file = _upload(api, data, key=SMALL)
        assert first_file.status_code == 200, first_file.text
        kept = _on_disk(tmp_path)
        assert len(kept["files"]) == 1
        refused = _upload(api, data, key=SMALL)
        error = _openai_error(refused, "max_stored_bytes")
        assert f"stores {len(data)} bytes" in error["message"] and f"quota of {STORED_MAX}" in error["message"]
        assert "retry-after" not in refused.headers
        assert _file_ids(api, SMALL) == [first_file.json()["id"]] and _on_disk(tmp_path)["files"] == kept["files"]

        first = submit(SMALL, teams["small"] / "1.json")
        assert first.status_code == 200, first.text
        first_id = first.json()["job_id"]
        deadline = time.monotonic() + 600
        while job(first_id)["status"] == "queued":
            assert time.monotonic() < deadline, served.log.read_text()[-3000:]
            time.sleep(0.2)

        # max_queued_jobs: while the one run slot is held, the other team's job waits in the store; one more
        # is a 429 and makes no job.
        waiting = submit(OTHER, teams["roomy"] / "1.json")
        assert waiting.status_code == 200, waiting.text
        waiting_id = waiting.json()["job_id"]
        listed, on_disk = _job_ids(api, OTHER), _on_disk(tmp_path)["work"]
        assert listed == [waiting_id] and job(waiting_id, OTHER)["status"] == "queued"
        refused = submit(OTHER, teams["roomy"] / "2.json")
        assert refused.status_code == 429, refused.text
        detail = refused.json()["detail"]
        assert detail.startswith("max_queued_jobs:") and "1 jobs waiting to start" in detail, detail
        assert refused.headers["retry-after"] == "30"
        assert _job_ids(api, OTHER) == listed and _on_disk(tmp_path)["work"] == on_disk
        cancelled = api.post(f"/v2/batch-completions/{waiting_id}/actions/cancel", headers={"x-api-key": OTHER})
        assert cancelled.status_code == 200 and cancelled.json()["success"] is True  # it need not run

        # max_tokens_per_day: once the real job has used its tokens.
        while (finished := job(first_id))["status"] in ("queued", "running"):
            assert time.monotonic() < deadline, served.log.read_text()[-3000:]
            time.sleep(1)
        assert finished["status"] == "completed", finished
        used = int(finished["metadata"]["prompt_tokens"]) + int(finished["metadata"]["completion_tokens"])
        assert used >= 1
        jobs_before = _job_ids(api, SMALL)
        refused = submit(SMALL, teams["small"] / "2.json")
        assert refused.status_code == 429, refused.text
        assert refused.json()["detail"].startswith(f"max_tokens_per_day: your team's jobs have used {used}/1 tokens")
        assert int(refused.headers["retry-after"]) > 0
        assert _job_ids(api, SMALL) == jobs_before == [first_id]
    finally:
        served.kill()


def test_a_batchs_copy_of_its_file_counts_so_batches_of_one_file_cannot_fill_the_disk(api, tmp_path):
    """Each batch keeps a copy of its input file in its job's work dir. On main none was counted: batches
    made from a file, which was then deleted, stored bytes without bound past max_stored_bytes."""
    bearer = {"Authorization": f"Bearer {SMALL}"}
    data = _jsonl([_line("a", content="x" * 250)])
    assert 3 * len(data) > STORED_MAX >= 2 * len(data)
    first = _upload(api, data, key=SMALL)
    assert first.status_code == 200, first.text
    batch = _create(api, first.json()["id"], key=SMALL)
    assert batch.status_code == 200, batch.text  # the file and one copy fit
    copy = sum(
        path.stat().st_size for path in (_home(tmp_path) / "work" / batch.json()["id"]).rglob("*") if path.is_file()
    )
    assert copy > len(data) / 2
    assert api.delete(f"/v1/files/{first.json()['id']}", headers=bearer).status_code == 200
    again = _upload(api, data, key=SMALL)  # the first batch's copy and this file fit
    assert again.status_code == 200, again.text
    refused = _create(api, again.json()["id"], key=SMALL)  # a second copy would not
    error = _openai_error(refused, "max_stored_bytes")
    assert "this batch's copy of its file" in error["message"]
    assert len(api.get("/v1/batches", headers=bearer).json()["data"]) == 1
    usage = api.get("/v2/usage", headers={"x-api-key": SMALL}).json()
    assert usage["teams"][0]["stored_bytes_now"] == len(data) + copy  # the file and the first batch's copy


# --- under concurrency (issue 44, finding 3) ------------------------------------------------------------

RACER, SPENDER = "key-of-the-racing-team", "key-of-the-spending-team"
QUEUED_MAX = 2


@pytest.fixture
def racing_teams(tmp_path, monkeypatch):
    """A team with a queue quota and one with a tokens quota, and the real app serving them on a real port."""
    roots = {name: tmp_path / name for name in ("racer", "spender")}
    for root in roots.values():
        root.mkdir()
    tenants_file = tmp_path / "tenants.yaml"
    tenants_file.write_text(
        "tenants:\n"
        "  racer:\n"
        f"    api_keys_sha256: [{_digest(RACER)}]\n"
        f"    data_roots: [{roots['racer']}]\n"
        f"    max_queued_jobs: {QUEUED_MAX}\n"
        "  spender:\n"
        f"    api_keys_sha256: [{_digest(SPENDER)}]\n"
        f"    data_roots: [{roots['spender']}]\n"
        f"    max_tokens_per_day: {TOKENS_MAX}\n"
    )
    monkeypatch.setenv("BATCH_PIPELINE_TENANTS", str(tenants_file))
    return roots


@contextlib.contextmanager
def served(app) -> Iterator[httpx.Client]:
    """The app on a real port (uvicorn in a thread, its routes on uvicorn's threads), and a client of it
    whose connections are not limited below the races' 40 requests."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the API did not start"
        time.sleep(0.05)
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120, limits=limits) as client:
            yield client
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _at_once(calls: list) -> list[httpx.Response]:
    """Each call in a thread of its own, all released together."""
    start = threading.Barrier(len(calls))

    def run(call):
        start.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


def race_the_queue_quota(client: httpx.Client, root, store: JobStore) -> None:
    """40 submissions of one team at once (v2, v1 and OpenAI batches) against its max_queued_jobs of 2: two
    are taken, every other is a 429 naming the quota, and the team has two jobs waiting. Then 19 of its
    stopped jobs resumed at once: two are queued again, the rest stay stopped."""
    headers, bearer = {"x-api-key": RACER}, {"Authorization": f"Bearer {RACER}"}
    uploaded = _upload(client, _jsonl([_line("a")]), key=RACER)
    assert uploaded.status_code == 200, uploaded.text

    def submission(i: int):
        if i % 5 == 4:
            return lambda: _create(client, uploaded.json()["id"], key=RACER)
        path = "/v2/batch-completions" if i % 2 else "/v1/llm/batch-completions"
        return lambda: client.post(path, json=_body(root / f"{i}.json"), headers=headers)

    answers = _at_once([submission(i) for i in range(40)])
    taken = [answer for answer in answers if answer.status_code == 200]
    refused = [answer for answer in answers if answer.status_code != 200]
    assert len(taken) == QUEUED_MAX, [answer.text for answer in taken]
    for answer in refused:
        assert answer.status_code == 429, answer.text
        text = answer.text
        # A batch may find every check of its team's input files busy first: a 429 of its own, storing nothing.
        assert "max_queued_jobs: your team has" in text or "batch input files being checked" in text, text
    assert QuotaStore(engine=store.engine).count_queued("team:racer") == QUEUED_MAX
    assert len(store.list(owner="team:racer").jobs) == QUEUED_MAX

    # 19 stopped jobs: made and cancelled one at a time, under the quota.
    for job in store.list(owner="team:racer").jobs:
        assert client.post(f"/v2/batch-completions/{job.job_id}/actions/cancel", headers=headers).status_code == 200
    stopped = [job.job_id for job in store.list(owner="team:racer").jobs]
    while len(stopped) < 19:
        made = client.post("/v2/batch-completions", json=_body(root / f"s{len(stopped)}.json"), headers=headers)
        assert made.status_code == 200, made.text
        job_id = made.json()["job_id"]
        assert client.post(f"/v2/batch-completions/{job_id}/actions/cancel", headers=headers).status_code == 200
        stopped.append(job_id)
    assert QuotaStore(engine=store.engine).count_queued("team:racer") == 0

    answers = _at_once(
        [lambda job_id=job_id: client.post(f"/v2/batch-completions/{job_id}/actions/resume", headers=headers)
         for job_id in stopped]
    )  # fmt: skip
    resumed = [answer for answer in answers if answer.status_code == 200]
    assert len(resumed) == QUEUED_MAX, [answer.text for answer in resumed]
    for answer in answers:
        if answer.status_code != 200:
            assert answer.status_code == 429 and answer.json()["detail"].startswith("max_queued_jobs:"), answer.text
    assert QuotaStore(engine=store.engine).count_queued("team:racer") == QUEUED_MAX
    assert client.get("/v1/batches", headers=bearer).status_code == 200


def race_the_tokens_quota(client: httpx.Client, root, store: JobStore) -> None:
    """40 submissions of one team at once, each estimated at 5 tokens, against its max_tokens_per_day of 100:
    each reserves its estimate as it is stored, so those past the budget are refused (20 fit: a job is taken
    while the day's count, estimates included, is below the quota), whatever their order."""
    headers = {"x-api-key": SPENDER}
    answers = _at_once(
        [lambda i=i: client.post("/v2/batch-completions", json=_body(root / f"{i}.json"), headers=headers)
         for i in range(40)]
    )  # fmt: skip
    taken = [answer for answer in answers if answer.status_code == 200]
    estimate = 5  # "hi" (one token at 4 characters a token, plus one) and its 4 new tokens
    assert len(taken) == TOKENS_MAX // estimate, [answer.text for answer in answers if answer.status_code != 200][:3]
    for answer in answers:
        if answer.status_code != 200:
            assert answer.status_code == 429, answer.text
            assert answer.json()["detail"].startswith("max_tokens_per_day: your team's jobs have used 0/"), answer.text
    assert (
        QuotaStore(engine=store.engine)
        .tokens_held_since("team:spender", datetime.now(UTC) - timedelta(days=1))
        .reserved
        == TOKENS_MAX
    )
    assert len(store.list(owner="team:spender").jobs) == TOKENS_MAX // estimate


def test_concurrent_submissions_and_resumes_of_one_team_leave_at_most_its_max_queued_jobs(
    racing_teams, tenants_api, tmp_path
):
    """Issue 44: 40 concurrent submissions of one team left 6 jobs queued against a quota of 2, and 19
    concurrent resumes left 3: the count and the insert were two steps. Through the real HTTP layer."""
    with served(tenants_api.app) as client:
        race_the_queue_quota(client, racing_teams["racer"], JobStore(settings().job_store_url))
    assert len(_on_disk(tmp_path)["work"]) == 19  # the refused left no work dir behind


def test_concurrent_submissions_cannot_all_pass_the_same_remaining_tokens(racing_teams, tenants_api):
    with served(tenants_api.app) as client:
        race_the_tokens_quota(client, racing_teams["spender"], JobStore(settings().job_store_url))


def test_a_job_naming_its_input_by_file_reserves_its_size_and_a_fifo_reserves_nothing(api, teams):
    """A job by `input_data_path` is estimated by its file's size (4 bytes a token), the file unread: a FIFO
    named as input does not hold the submission (an open() of it would wait for a writer for ever)."""
    small = teams["small"]
    (small / "in.jsonl").write_text(json.dumps({"prompt": "x" * 35, "max_tokens": 4}) + "\n")
    os.mkfifo(small / "pipe.jsonl")

    def by_path(name: str):
        body = _body(small / f"{name}.out.json") | {"input_data_path": str(small / name)}
        del body["content"]
        return api.post("/v2/batch-completions", json=body, headers={"x-api-key": SMALL})

    made = by_path("in.jsonl")
    assert made.status_code == 200, made.text
    assert _estimate(made.json()["job_id"]) == os.path.getsize(small / "in.jsonl") // 4 + 1
    piped = by_path("pipe.jsonl")
    assert piped.status_code == 200, piped.text
    assert _estimate(piped.json()["job_id"]) == 1


def _plan(api, job_id: str) -> dg.JobExecutionResult:
    """The run the jobs sensor asks for the job, executed on the deployment's instance up to its planning."""
    from batch_pipeline.pipeline.definitions import batch_completions_job
    from batch_pipeline.pipeline.runs import launch_key
    from batch_pipeline.pipeline.sensors import run_request_for

    service = api.app.state.job_service
    request = run_request_for(service.store.get(job_id), None, launch_key(service.instance))
    return dg.execute_job(
        dg.reconstructable(batch_completions_job),
        instance=service.instance,
        run_config=request.run_config,
        tags=request.tags,
        op_selection=["validate_input", "plan_shards"],
        raise_on_error=False,
    )


def test_jobs_whose_input_files_grew_after_submission_are_held_to_the_day_at_planning(api, teams):
    """Found by the attacker's pass (issue 44): a file reserves its size at submission, unread, and is read
    at planning: many jobs naming files of a few bytes each passed a budget their grown files then ran far
    past. Planning reserves what it read, under the team's lock: once the others hold the day, it stops."""
    files = [teams["small"] / f"prompts-{n}.jsonl" for n in range(2)]
    for path in files:
        path.write_text("")  # a few bytes: each job reserves ~1 token of the team's 100
    job_ids = []
    for n, path in enumerate(files):
        body = _body(teams["small"] / f"out-{n}.json") | {"input_data_path": str(path)}
        del body["content"]
        response = api.post("/v2/batch-completions", json=body, headers={"x-api-key": SMALL})
        assert response.status_code == 200, response.text
        job_ids.append(response.json()["job_id"])
    grown = "".join(json.dumps({"prompt": "Tell me more " * 20, "max_tokens": 40}) + "\n" for _ in range(5))
    for path in files:
        path.write_text(grown)  # ~100 prompt tokens and 200 of output each: past the day on its own

    store = api.app.state.job_service.store
    owner, midnight = store.get(job_ids[0]).owner, datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    first = _plan(api, job_ids[0])
    assert first.success  # the team held ~1 token besides it: it runs, as a submission would be taken
    held = QuotaStore(engine=store.engine).tokens_held_since(owner, midnight).held
    assert held > 3 * TOKENS_MAX  # what the grown file holds, not its size at submission
    second = _plan(api, job_ids[1])
    assert not second.success
    (failure,) = [event for event in second.all_events if event.is_step_failure]
    message = failure.step_failure_data.error.message
    assert "max_tokens_per_day" in message and "resume it after 00:00 UTC" in message, message
    assert (
        QuotaStore(engine=store.engine).tokens_held_since(owner, midnight).held == held
    )  # nothing reserved for what it will not run
