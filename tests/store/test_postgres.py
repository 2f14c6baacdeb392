"""The production storage: Dagster's runs, events and schedules and the job store in one real PostgreSQL
15 server (started here with initdb and pg_ctl on 127.0.0.1), through the API, the sensor and a real job."""

import json
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import dagster as dg
import pytest
import sqlalchemy as sa

from batch_pipeline.api.app import create_app
from batch_pipeline.api.service import BatchJobService
from batch_pipeline.contract.labels import MAX_LABEL_KEY_CHARS, MAX_LABEL_VALUE_CHARS, MAX_LABELS
from batch_pipeline.core.settings import settings
from batch_pipeline.pipeline.tags import JOB_ID_TAG, LABEL_TAG_PREFIX, label_tag_key
from batch_pipeline.store.jobs import JobStore
from tests.admission.test_quotas import race_the_queue_quota, race_the_tokens_quota, racing_teams, served
from tests.api_fixtures import REPO, USER_KEY, Deployment
from tests.conftest import MODEL

__all__ = ["racing_teams"]  # a fixture of test_quotas', used here

pytestmark = pytest.mark.slow
PG_BIN = next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)), None)


def _as_postgres_user(command: list[str]) -> list[str]:
    # initdb and postgres refuse to run as root
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


@pytest.fixture
def postgres():
    if PG_BIN is None:
        pytest.fail("PostgreSQL is not installed (/usr/lib/postgresql/*/bin)")
    # Outside pytest's private tmp tree: the postgres user must reach it.
    data = Path(tempfile.mkdtemp(prefix="batch-pipeline-pg-"))
    if os.geteuid() == 0:
        shutil.chown(data, "postgres")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    subprocess.run(
        _as_postgres_user([str(PG_BIN / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"]),
        check=True,
        capture_output=True,
    )
    subprocess.run(
        _as_postgres_user(
            [
                str(PG_BIN / "pg_ctl"),
                "-D",
                str(data),
                "-l",
                str(data / "log"),
                "-w",
                "-o",
                f"-p {port} -k {data} -c listen_addresses=127.0.0.1",
                "start",
            ]
        ),
        check=True,
        capture_output=True,
    )
    subprocess.run(
        _as_postgres_user([str(PG_BIN / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "batch"]),
        check=True,
        capture_output=True,
    )
    yield port
    subprocess.run(
        _as_postgres_user([str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]), capture_output=True
    )
    shutil.rmtree(data, ignore_errors=True)


def test_api_sensor_and_job_run_on_postgres_with_the_shipped_instance_config(postgres, tmp_path, monkeypatch):
    jobs_db = _postgres_environment(postgres, tmp_path / "home", monkeypatch)
    api = Deployment(
        tmp_path / "home",
        max_concurrent_runs=1,
        instance_yaml=(REPO / "deploy" / "dagster-postgres.yaml").read_text(),
        jobs_db=jobs_db,
    )
    try:
        api.start_daemon()
        output = tmp_path / "out.json"
        body = {
            "output_data_path": str(output),
            "model_config": {"model": MODEL},
            "content": {"prompts": ["The capital of France is"], "max_new_tokens": 4, "temperature": 0.0},
        }
        job_id = api.client.post("/v2/batch-completions", json=body, headers={"x-api-key": USER_KEY}).json()["job_id"]
        job = api.wait_for(job_id, lambda j: j["status"] in ("completed", "failed"), timeout=400)
        assert job["status"] == "completed", job
        assert len(json.loads(output.read_text())) == 1
        # Filters Postgres cannot compare (a NUL) match nothing, rather than fail the list.
        for params in (
            {"label": "team\x00:x"},
            {"label": "team:\x00"},
            {"after": "batch-\x00"},
            {"after": "x" * 10_000},
        ):
            listed = api.client.get("/v2/batch-completions", params=params, headers={"x-api-key": USER_KEY})
            assert listed.status_code == 200 and listed.json()["jobs"] == [], (params, listed.text)
        # An OpenAI batch, its files and its rows in the same database; ids Postgres cannot compare are absent.
        bearer = {"Authorization": f"Bearer {USER_KEY}"}
        line = {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
        }
        file_id = api.client.post(
            "/v1/files",
            headers=bearer,
            data={"purpose": "batch"},
            files={"file": ("in.jsonl", json.dumps(line).encode())},
        ).json()["id"]
        batch = api.client.post(
            "/v1/batches",
            headers=bearer,
            json={"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"},
        ).json()
        finished = api.wait_for(batch["id"], lambda j: j["status"] in ("completed", "failed"), timeout=400)
        assert finished["status"] == "completed", finished
        deadline = time.monotonic() + 30
        while (batch := api.client.get(f"/v1/batches/{batch['id']}", headers=bearer).json())["status"] != "completed":
            assert time.monotonic() < deadline, batch
            time.sleep(0.5)
        output = api.client.get(f"/v1/files/{batch['output_file_id']}/content", headers=bearer).json()
        assert output["custom_id"] == "a" and output["response"]["body"]["object"] == "text_completion"
        for path in ("/v1/files/file-%00", "/v1/batches/batch-%00", "/v1/files/" + "x" * 10_000):
            assert api.client.get(path, headers=bearer).status_code == 404, path
        for path in ("/v1/batches", "/v1/files"):
            listed = api.client.get(path, params={"after": "x\x00"}, headers=bearer)
            assert listed.status_code == 200 and listed.json()["data"] == [], listed.text
    finally:
        api.stop()
    engine = sa.create_engine(jobs_db)
    with engine.connect() as connection:
        tables = set(sa.inspect(connection).get_table_names())
        stored = connection.execute(sa.text("select run_id from batch_jobs where job_id = :id"), {"id": job_id}).one()
        run_status = connection.execute(
            sa.text("select status from runs where run_id = :id"), {"id": stored.run_id}
        ).one()
    assert {"batch_jobs", "runs", "event_logs", "jobs"} <= tables  # the job store and Dagster's storage, one database
    assert run_status.status == "SUCCESS"
    assert not list((tmp_path / "home").glob("**/*.db"))  # nothing fell back to SQLite


def _postgres_environment(port: int, home: Path, monkeypatch) -> str:
    """Dagster's storage and the job store in the test's server, as the shipped instance config reads them;
    the job store's URL."""
    jobs_db = f"postgresql+psycopg2://postgres@127.0.0.1:{port}/batch"
    for key, value in {
        "DAGSTER_PG_USERNAME": "postgres",
        "DAGSTER_PG_PASSWORD": "",
        "DAGSTER_PG_HOST": "127.0.0.1",
        "DAGSTER_PG_PORT": str(port),
        "DAGSTER_PG_DB": "batch",
        "BATCH_PIPELINE_JOBS_DB": jobs_db,
        "BATCH_PIPELINE_SENSOR_INTERVAL_S": "1",
        "DAGSTER_HOME": str(home),
    }.items():
        monkeypatch.setenv(key, value)
    return jobs_db


def _largest_labels() -> dict[str, str]:
    """The largest labels allowed, in bytes: every character 4 bytes of UTF-8, none repeated in a pattern that
    Postgres could compress in its index."""
    draw = random.Random(25)

    def text(length: int) -> str:
        return "".join(chr(draw.randrange(0x10000, 0x1FFFF)) for _ in range(length))

    return {text(MAX_LABEL_KEY_CHARS): text(MAX_LABEL_VALUE_CHARS) for _ in range(MAX_LABELS)}


def test_labels_past_the_bounds_get_422_and_the_largest_allowed_make_one_run_on_postgres(
    postgres, tmp_path, monkeypatch
):
    jobs_db = _postgres_environment(postgres, tmp_path / "home", monkeypatch)
    # Runs are queued and never started: the job's one run is all this watches.
    instance_yaml = (REPO / "deploy" / "dagster-postgres.yaml").read_text()
    assert "max_concurrent_runs: 2" in instance_yaml
    api = Deployment(
        tmp_path / "home",
        max_concurrent_runs=0,
        instance_yaml=instance_yaml.replace("max_concurrent_runs: 2", "max_concurrent_runs: 0"),
        jobs_db=jobs_db,
    )
    headers = {"x-api-key": USER_KEY}
    body = {
        "output_data_path": str(tmp_path / "out.json"),
        "model_config": {"model": MODEL},
        "content": {"prompts": ["The capital of France is"], "max_new_tokens": 4, "temperature": 0.0},
    }
    try:
        # A 6,000-character value broke Dagster's tag index here, and a 5 kB key the job store's.
        unbounded = random.Random(6000)
        for labels in (
            {"team": "".join(chr(unbounded.randrange(0x10000, 0x1FFFF)) for _ in range(6000))},
            {"k" * 5000: "v"},
            {f"k{i}": "v" for i in range(MAX_LABELS + 1)},
        ):
            response = api.client.post("/v2/batch-completions", json={**body, "labels": labels}, headers=headers)
            assert response.status_code == 422, response.text[:500]
            assert [error["loc"] for error in response.json()["detail"]] == [["body", "labels"]]
        # The model is a run tag and a column of the job store too.
        long_model = {**body, "model_config": {"model": "m" * 257}}
        response = api.client.post("/v2/batch-completions", json=long_model, headers=headers)
        assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "model_config", "model"]
        assert api.store.list().jobs == []

        labels = _largest_labels()
        job_id = api.client.post("/v2/batch-completions", json={**body, "labels": labels}, headers=headers).json()[
            "job_id"
        ]
        api.start_daemon()
        deadline = time.monotonic() + 180
        while api.store.get(job_id).run_id is None:  # the sensor found the job's run by its tags and linked it
            log = (api.home / "daemon.log").read_text() if (api.home / "daemon.log").exists() else ""
            assert time.monotonic() < deadline, f"the job's run was never linked; daemon log tail:\n{log[-3000:]}"
            time.sleep(1)
        time.sleep(8)  # more ticks of the 1 s sensor: none may launch the job again
        runs = api.instance.get_runs(filters=dg.RunsFilter(job_name="batch_completions"))
        assert [run.run_id for run in runs] == [api.store.get(job_id).run_id]
        assert runs[0].tags[JOB_ID_TAG] == job_id
        assert {key: value for key, value in runs[0].tags.items() if key.startswith(LABEL_TAG_PREFIX)} == {
            label_tag_key(key): value for key, value in labels.items()
        }
        listed = api.client.get(
            "/v2/batch-completions",
            params={"label": f"{next(iter(labels))}:{next(iter(labels.values()))}"},
            headers=headers,
        )
        assert [job["job_id"] for job in listed.json()["jobs"]] == [job_id]
    finally:
        api.stop()


def test_quotas_hold_under_concurrent_submissions_and_resumes_on_postgres(
    postgres, racing_teams, tmp_path, monkeypatch
):
    """Issue 44's quota races on the production job store: 40 concurrent submissions of one team (v1, v2,
    OpenAI batches) leave its max_queued_jobs of 2 queued and the rest get 429, 19 concurrent resumes queue
    two again, and 40 concurrent submissions cannot all pass the same remaining tokens of the day. Each
    admission counts under the team's advisory lock, in the transaction that stores the job."""
    jobs_db = f"postgresql+psycopg2://postgres@127.0.0.1:{postgres}/batch"
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.setenv("BATCH_PIPELINE_JOBS_DB", jobs_db)
    instance = dg.DagsterInstance.from_config(str(home))
    store = JobStore(jobs_db)
    try:
        with served(create_app(BatchJobService.of_deployment(settings(), store, instance))) as client:
            race_the_queue_quota(client, racing_teams["racer"], store)
            race_the_tokens_quota(client, racing_teams["spender"], store)
    finally:
        instance.dispose()
