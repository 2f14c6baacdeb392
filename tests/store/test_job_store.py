"""The job store: a versioned schema that upgrades whatever database an older release left, one engine per
process, and status reads that are queries over rows (filters and pages in SQL)."""

import json
import multiprocessing
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from batch_pipeline.store.jobs import JobStore
from batch_pipeline.store.progress import ShardProgressStore
from batch_pipeline.store.records import NewJob
from batch_pipeline.store.results import JobResults
from batch_pipeline.store.schema import SCHEMA_VERSION_TABLE

MODEL = "smollm2-135m-instruct"
FIRST_RELEASE_TABLE = (
    "CREATE TABLE batch_jobs (job_id VARCHAR(64) PRIMARY KEY, owner VARCHAR(128) NOT NULL, "
    "idempotency_key VARCHAR(256), request TEXT NOT NULL, priority VARCHAR(64), labels TEXT NOT NULL, "
    "created_at DATETIME NOT NULL, expires_at DATETIME NOT NULL, run_id VARCHAR(64), cancelled_at DATETIME, "
    "CONSTRAINT uq_owner_idempotency_key UNIQUE (owner, idempotency_key))"
)


def _new_job(owner: str = "alice", labels: dict | None = None, key: str | None = None) -> NewJob:
    request = {"output_data_path": "/tmp/o.json", "model_config": {"model": MODEL}, "input_data_path": "/tmp/i.json"}
    return NewJob(
        job_id=NewJob.new_id(),
        owner=owner,
        request_json=json.dumps(request),
        request_sha256="0" * 64,
        model=MODEL,
        priority=None,
        labels=labels or {},
        max_runtime_sec=60,
        idempotency_key=key,
    )


def _old_database(path, extra_columns: str = "") -> str:
    url = f"sqlite:///{path}"
    engine = sa.create_engine(url)
    now = datetime.now(UTC)
    request = json.dumps({"output_data_path": "/tmp/o.json", "model_config": {"model": MODEL}, "content": {}})
    with engine.begin() as connection:
        connection.exec_driver_sql(FIRST_RELEASE_TABLE)
        for column in filter(None, extra_columns.split(",")):
            connection.exec_driver_sql(f"ALTER TABLE batch_jobs ADD COLUMN {column}")
        for job_id, run_id, cancelled_at in [
            ("batch-queued", None, None),
            ("batch-launched", "run-1", None),
            ("batch-cancelled", None, now),
        ]:
            connection.execute(
                sa.text(
                    "INSERT INTO batch_jobs (job_id, owner, request, labels, created_at, expires_at, run_id, "
                    "cancelled_at) VALUES (:id, 'alice', :request, :labels, :now, :later, :run, :cancelled)"
                ),
                {
                    "id": job_id,
                    "request": request,
                    "labels": json.dumps({"team": job_id}),
                    "now": now,
                    "later": now + timedelta(days=1),
                    "run": run_id,
                    "cancelled": cancelled_at,
                },
            )
    engine.dispose()
    return url


def test_a_first_release_database_is_upgraded_with_its_rows_given_a_status_and_their_labels_indexed(tmp_path):
    store = JobStore(_old_database(tmp_path / "first.db"))
    assert store.get("batch-queued").status == "queued"
    assert store.get("batch-launched").status == "running"  # the jobs sensor reconciles it with its run
    cancelled = store.get("batch-cancelled")
    assert cancelled.status == "cancelled" and cancelled.completed_at == cancelled.cancelled_at
    assert store.get("batch-queued").model == MODEL
    assert [job.job_id for job in store.list(labels={"team": "batch-cancelled"}).jobs] == ["batch-cancelled"]
    assert [[job.job_id for job in chunk] for chunk in store.awaiting_launch()] == [["batch-queued"]]
    with store.engine.connect() as connection:
        assert connection.execute(sa.text(f"SELECT version_num FROM {SCHEMA_VERSION_TABLE}")).scalar() == _head()
        # OpenAI's Batch API tables came with the upgrade, empty.
        assert connection.execute(sa.text("SELECT count(*) FROM openai_batches")).scalar() == 0
        assert connection.execute(sa.text("SELECT count(*) FROM openai_files")).scalar() == 0
    created, _ = store.create(_new_job(key="k"))
    assert store.get(created.job_id).status == "queued"


def test_a_database_of_the_hardening_release_keeps_its_columns_and_is_upgraded(tmp_path):
    url = _old_database(tmp_path / "second.db", "request_sha256 VARCHAR(64),failed_at DATETIME,failure_reason TEXT")
    store = JobStore(url)
    assert store.get("batch-queued").failure_reason is None and store.get("batch-queued").status == "queued"


def _open_store(url: str) -> str:
    return JobStore(url).get("batch-queued").status


@pytest.mark.slow  # starts processes that upgrade one schema together
def test_processes_starting_together_upgrade_the_schema_once_without_failing(tmp_path):
    url = _old_database(tmp_path / "raced.db")
    pool = multiprocessing.get_context("spawn").Pool(4)
    try:
        assert pool.map(_open_store, [url] * 4) == ["queued"] * 4
    finally:
        # Not the context manager's terminate(): it holds the task queue's lock and relies on SIGTERM to stop
        # the workers, and after an in-process Dagster run this process ignores SIGTERM wherever it was
        # started ignoring SIGINT (Dagster maps SIGTERM to SIGINT's handler). A clean-clone CI hung here.
        pool.close()
        pool.join()


def test_one_engine_per_process_and_url(tmp_path):
    url = f"sqlite:///{tmp_path}/jobs.db"
    assert JobStore(url).engine is JobStore(url).engine


def test_lists_are_filtered_and_paged_in_sql_newest_first(tmp_path):
    store = JobStore(f"sqlite:///{tmp_path}/jobs.db")
    made = [store.create(_new_job(labels={"team": "a" if i % 2 else "b", "n": str(i)}))[0].job_id for i in range(7)]
    store.create(_new_job(owner="bob", labels={"team": "a"}))
    pages, after = [], None
    while True:
        page = store.list(owner="alice", limit=3, after=after)
        pages.append([job.job_id for job in page.jobs])
        if page.next_after is None:
            break
        after = page.next_after
    assert [job for page in pages for job in page] == made[::-1] and [len(p) for p in pages] == [3, 3, 1]
    assert [j.job_id for j in store.list(owner="alice", labels={"team": "a"}).jobs] == [made[5], made[3], made[1]]
    assert [j.job_id for j in store.list(labels={"team": "a", "n": "3"}).jobs] == [made[3]]
    assert store.list(owner="alice", status="running").jobs == []
    assert store.list(after="batch-no-such-job").jobs == []


def test_progress_reports_sum_into_the_job_row(tmp_path):
    store = JobStore(f"sqlite:///{tmp_path}/jobs.db")
    job, _ = store.create(_new_job())
    assert store.mark_started(job.job_id, "run-1")
    ShardProgressStore(engine=store.engine).record_shards(job.job_id, {0: 10, 1: 6})
    ShardProgressStore(engine=store.engine).record_shard_progress(
        job.job_id, 0, {"requests_done": 4, "completion_tokens": 40, "errors": 1}
    )
    ShardProgressStore(engine=store.engine).record_shard_progress(
        job.job_id, 1, {"requests_done": 6, "completion_tokens": 50}
    )
    ShardProgressStore(engine=store.engine).record_shard_progress(
        job.job_id, 0, {"requests_done": 7, "completion_tokens": 70, "errors": 1}
    )
    row = store.get(job.job_id)
    assert (row.status, row.requests_total, row.requests_done, row.completion_tokens, row.errors) == (
        "running",
        16,
        13,
        120,
        1,
    )
    assert row.queue_wait_s is not None and row.queue_wait_s >= 0


def test_a_runs_results_are_recorded_with_their_counts_and_an_older_releases_still_read(tmp_path):
    store = JobStore(f"sqlite:///{tmp_path}/jobs.db")
    job, _ = store.create(_new_job())
    assert store.mark_started(job.job_id, "run-1")
    results = JobResults(
        num_requests=3, num_errors=1, completion_tokens=30, wall_s=2.5, requests_total=3, requests_done=3, errors=1
    )
    ShardProgressStore(engine=store.engine).record_results(job.job_id, "run-1", results)
    row = store.get(job.job_id)
    assert row.results == results and (row.requests_total, row.requests_done, row.errors) == (3, 3, 1)
    with store.engine.begin() as connection:
        raw = connection.execute(sa.text("SELECT results FROM batch_jobs")).scalar_one()
    assert json.loads(raw) == {
        "num_requests": 3,
        "num_errors": 1,
        "completion_tokens": 30,
        "wall_s": 2.5,
        "requests_total": 3,
        "requests_done": 3,
        "errors": 1,
    }

    # A summary with a figure this release no longer knows: ignored; those it did not write read None.
    with store.engine.begin() as connection:
        connection.execute(sa.text("UPDATE batch_jobs SET results = :r"), {"r": '{"num_requests": 2, "gone": [1]}'})
    assert store.get(job.job_id).results == JobResults(num_requests=2)


def _head() -> str:
    """The newest revision of the store's migrations: what an upgraded store is at."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    config = Config()
    config.set_main_option("script_location", "batch_pipeline.store:migrations")
    return ScriptDirectory.from_config(config).get_current_head()
