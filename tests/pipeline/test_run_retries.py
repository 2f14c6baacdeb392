"""Faults heal without an operator: the real daemon retries a run whose run worker was killed, and every run
of a job stops at the job's expires_at. Real Dagster (daemon, code server, run workers), real vLLM."""

import json
import os
import re
import signal
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

import dagster as dg
import pytest

from batch_pipeline.pipeline.tags import DEADLINE_TAG, MAX_RUNTIME_TAG, RUN_MONITORING_GRACE_S
from tests.api_fixtures import REPO, USER_KEY, Deployment
from tests.conftest import MODEL, worker_pids

pytestmark = pytest.mark.slow
ALICE = {"x-api-key": USER_KEY}


@pytest.fixture
def deployment(tmp_path, monkeypatch):
    """The API and the daemon on the shipped local instance config (dagster_home/dagster.yaml: run retries
    on), in a DAGSTER_HOME of the test's own."""
    home = tmp_path / "dagster_home"
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.setenv("BATCH_PIPELINE_JOBS_DB", f"sqlite:///{home}/batch_jobs.db")
    monkeypatch.setenv("BATCH_PIPELINE_SENSOR_INTERVAL_S", "1")
    monkeypatch.delenv("BATCH_PIPELINE_WORK_DIR", raising=False)
    api = Deployment(home, 1, instance_yaml=(REPO / "dagster_home" / "dagster.yaml").read_text())
    yield api
    api.stop()


def _run_worker_pid(instance: dg.DagsterInstance, run_id: str) -> int:
    """The process executing the run (the code server's child), as its first engine event names it."""
    for entry in instance.all_logs(run_id, of_type=dg.DagsterEventType.ENGINE_EVENT):
        if match := re.match(r"Started process for run \(pid: (\d+)\)", entry.message or ""):
            return int(match.group(1))
    raise AssertionError(f"run {run_id} has no run worker process")


def _settled(api: Deployment, job: dict) -> bool:
    """Finished for good: completed, or failed with no automatic retry coming."""
    if job["status"] not in ("failed", "cancelled"):
        return job["status"] == "completed"
    run = api.instance.get_run_by_id(job["metadata"]["dagster_run_id"])
    return not (run.is_complete_and_waiting_to_retry or run.tags.get("dagster/auto_retry_run_id"))


def test_a_killed_run_worker_is_retried_by_the_daemon_and_the_job_completes_with_every_result_once(
    deployment, tmp_path, monkeypatch
):
    api = deployment
    # One shard at a time, so the second shard has never started when the run worker dies: re-executing
    # from failure would not select it again.
    monkeypatch.setenv("BATCH_PIPELINE_LOCAL_SHARD_CONCURRENCY", "1")
    monkeypatch.setenv("BATCH_PIPELINE_MAX_SHARDS_PER_JOB", "2")  # two shards, one after the other
    api.start_daemon()
    # echo: each output starts with its own prompt, so the output says which request it answers. Lengths
    # differ, so a shard finishes its requests one after another, not all at once.
    prompts = [f"Request {i}: once upon a time, a robot" for i in range(12)]
    requests = [
        {"prompt": p, "max_tokens": 8 + 24 * (i // 2), "ignore_eos": True, "temperature": 0.0, "echo": True}
        for i, p in enumerate(prompts)
    ]
    output = tmp_path / "output.json"
    job_id = api.client.post(
        "/v2/batch-completions",
        json={
            "content": requests,
            "output_data_path": str(output),
            "model_config": {"model": MODEL},
            "data_parallelism": 2,
        },
        headers=ALICE,
    ).json()["job_id"]

    # Killed mid-job: the first shard has results on disk and more in flight, the second has not started.
    shards = Path(os.environ["DAGSTER_HOME"]) / "work" / job_id / "shards"
    first_shard_results = shards / "000" / "results.tsv"
    deadline = time.monotonic() + 400
    while not (first_shard_results.exists() and first_shard_results.read_text().count("\n") >= 1):
        assert time.monotonic() < deadline, f"no result appeared; job: {api.job(job_id)}"
        time.sleep(0.2)
    first_run_id = api.job(job_id)["metadata"]["dagster_run_id"]
    assert first_shard_results.read_text().count("\n") < 6 and not (shards / "001" / "results.tsv").exists()
    os.kill(_run_worker_pid(api.instance, first_run_id), signal.SIGKILL)

    job = api.wait_for(job_id, lambda j: _settled(api, j), timeout=500)
    assert job["status"] == "completed", job
    first_run = api.instance.get_run_by_id(first_run_id)
    assert first_run.status == dg.DagsterRunStatus.FAILURE
    # The job is reported by the daemon's retry of the first run, not by the run that failed.
    retry = api.instance.get_run_by_id(job["metadata"]["dagster_run_id"])
    assert retry.run_id != first_run_id and retry.root_run_id == first_run_id
    assert retry.tags["dagster/retry_number"] == "1" and retry.status == dg.DagsterRunStatus.SUCCESS
    assert retry.tags[DEADLINE_TAG] == first_run.tags[DEADLINE_TAG]  # a retry keeps the job's deadline
    # No partial output was written for the run the daemon was about to retry.
    assert "batch_pipeline/partial_results" not in first_run.tags

    outputs = json.loads(output.read_text())
    assert len(outputs) == len(prompts)
    for prompt, entry in zip(prompts, outputs):  # every request once, in input order
        assert entry["choices"][0]["text"].startswith(prompt), (prompt, entry)
    assert job["metadata"]["num_requests"] == "12" and job["metadata"]["num_errors"] == "0"
    # Each request was generated once: the killed run's shard worker stopped with it instead of writing on
    # beside the retry's, and the retry resumed the first shard from its checkpoint.
    for shard in ("000", "001"):
        indices = Counter(line.split("\t", 1)[0] for line in (shards / shard / "results.tsv").read_text().splitlines())
        assert len(indices) == 6 and set(indices.values()) == {1}, (shard, indices)
    metadata = json.loads(Path(str(output) + ".metadata.json").read_text())
    assert metadata["dagster_run_id"] == retry.run_id and metadata["shards"][0]["resumed"] >= 1
    assert not worker_pids()


def test_a_job_whose_run_starts_late_stops_at_its_expires_at_the_deadline_every_run_enforces(deployment, tmp_path):
    api = deployment
    # 4 requests done in a few tokens, 4 that would need minutes here: the deadline falls between them.
    short = [{"prompt": f"Short {i}:", "max_tokens": 2, "temperature": 0.0} for i in range(4)]
    long = [{"prompt": f"Long {i}:", "max_tokens": 3000, "ignore_eos": True, "temperature": 0.0} for i in range(4)]
    output = tmp_path / "output.json"
    job_id = api.client.post(
        "/v2/batch-completions",
        json={
            "content": short + long,
            "output_data_path": str(output),
            "model_config": {"model": MODEL},
            "max_runtime_sec": 120,
        },
        headers=ALICE,
    ).json()["job_id"]
    expires_at = datetime.fromisoformat(api.job(job_id)["expires_at"])
    time.sleep(45)  # nothing launches it yet: its run starts 45 s or more after submission
    api.start_daemon()

    job = api.wait_for(job_id, lambda j: _settled(api, j), timeout=400)
    assert job["status"] == "failed", job
    assert "max_runtime_sec exceeded" in job["metadata"]["failure_reason"], job
    # Stopped at expires_at (the run's own start + max_runtime_sec would be 45 s or more later); the margin
    # is for a shared, loaded machine: the workers check the deadline at every engine step.
    stopped_after = (datetime.fromisoformat(job["completed_at"]) - expires_at).total_seconds()
    assert 0 <= stopped_after < 35, stopped_after
    run = api.instance.get_run_by_id(job["metadata"]["dagster_run_id"])
    record = api.instance.get_run_record_by_id(run.run_id)
    assert float(run.tags[DEADLINE_TAG]) == expires_at.timestamp()
    # Run monitoring's limit, counted from the run's start, ends at the same instant (plus its grace).
    monitored_until = record.start_time + int(run.tags[MAX_RUNTIME_TAG]) - RUN_MONITORING_GRACE_S
    assert abs(monitored_until - expires_at.timestamp()) <= 1.5
    assert run.tags.get("dagster/will_retry") == "false"  # out of time: a retry would only stop again
    deadline = time.monotonic() + 60
    while not Path(str(output) + ".metadata.json").exists():  # the failure sensor keeps the finished results
        assert time.monotonic() < deadline, "no partial output was written"
        time.sleep(0.5)
    outputs = json.loads(output.read_text())
    assert len(outputs) == 8 and {o["error"]["code"] for o in outputs[4:]} == {"job_failed"}


def test_a_job_failing_for_a_reason_of_its_own_is_not_retried(deployment, tmp_path):
    api = deployment
    api.start_daemon()
    job_id = api.client.post(
        "/v2/batch-completions",
        json={
            "input_data_path": str(tmp_path / "nowhere.json"),
            "output_data_path": str(tmp_path / "output.json"),
            "model_config": {"model": MODEL},
        },
        headers=ALICE,
    ).json()["job_id"]
    job = api.wait_for(job_id, lambda j: j["status"] in ("completed", "failed", "cancelled"), timeout=300)
    assert job["status"] == "failed" and "input_data_path: no file at" in job["metadata"]["failure_reason"]
    time.sleep(10)  # the daemon had its chance to retry it
    run = api.instance.get_run_by_id(job["metadata"]["dagster_run_id"])
    assert run.tags.get("dagster/will_retry") == "false" and "dagster/auto_retry_run_id" not in run.tags
    assert len(api.instance.get_runs()) == 1
    assert api.job(job_id)["status"] == "failed"
