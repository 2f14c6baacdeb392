"""The production storage: Dagster's runs, events and schedules and the job store in one real PostgreSQL
15 server (started here with initdb and pg_ctl on 127.0.0.1), through the API, the sensor and a real job."""

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.api_fixtures import REPO, USER_KEY, Deployment
from tests.conftest import MODEL

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
    jobs_db = f"postgresql+psycopg2://postgres@127.0.0.1:{postgres}/batch"
    for key, value in {
        "DAGSTER_PG_USERNAME": "postgres",
        "DAGSTER_PG_PASSWORD": "",
        "DAGSTER_PG_HOST": "127.0.0.1",
        "DAGSTER_PG_PORT": str(postgres),
        "DAGSTER_PG_DB": "batch",
        "BATCH_PIPELINE_JOBS_DB": jobs_db,
        "BATCH_PIPELINE_SENSOR_INTERVAL_S": "1",
        "DAGSTER_HOME": str(tmp_path / "home"),
    }.items():
        monkeypatch.setenv(key, value)
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
