"""A cancelled job reads `cancelled` only once it has stopped: its run ended and the results its shards
finished are in its output. Until then it reads as it did (Scale's statuses have no `cancelling`), says
when the cancel was asked, and an OpenAI batch says `cancelling`. Fast tests over the API, a real Dagster
instance and job store (no daemon); the slow one cancels a real job through `serve`."""

import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from batch_pipeline.core.settings import settings
from batch_pipeline.store.progress import ShardProgressStore
from batch_pipeline.store.results import JobResults
from batch_pipeline.store.schema import JobStatus
from tests.api.test_api import _body
from tests.api_fixtures import USER_KEY

ALICE = {"x-api-key": USER_KEY}


def _listed(api, status: str) -> set[str]:
    response = api.client.get("/v2/batch-completions", params={"status": status}, headers=ALICE)
    assert response.status_code == 200, response.text
    return {job["job_id"] for job in response.json()["jobs"]}


def _resume(api, job_id: str):
    return api.client.post(f"/v2/batch-completions/{job_id}/actions/resume", headers=ALICE)


def test_a_job_cancelled_while_running_reads_running_until_its_run_ended_and_its_partial_output_is_kept(
    deployment_factory, tmp_path
):
    api = deployment_factory()
    job_id = api.client.post("/v2/batch-completions", json=_body(tmp_path), headers=ALICE).json()["job_id"]
    assert api.store.mark_started(job_id, "run-1")
    ShardProgressStore(engine=api.store.engine).record_shards(job_id, {0: 2})
    (Path(api.service.job_storage.work_dir(job_id)) / "shards" / "000").mkdir(parents=True)

    api.store.mark_cancelled(job_id)  # what the cancel route does once the run is asked to stop
    for stage in ("run still stopping", "run ended, partial output not written yet"):
        job = api.job(job_id)
        assert job["status"] == "running", stage
        assert job["completed_at"] is None, stage
        assert datetime.fromisoformat(job["metadata"]["cancel_requested_at"]) <= datetime.now(UTC)
        assert job_id in _listed(api, "running") and job_id not in _listed(api, "cancelled"), stage
        response = _resume(api, job_id)
        assert response.status_code == 409 and "still stopping" in response.json()["detail"], stage
        api.store.mark_run_ended(job_id, "run-1", JobStatus.CANCELLED, datetime.now(UTC), keeping_partial_results=True)

    # keep_partial_results recorded the output it wrote: the job has stopped, and may be resumed at once.
    results = JobResults(job_id=job_id, dagster_run_id="run-1", status="cancelled", num_requests=2, num_finished=1)
    ShardProgressStore(engine=api.store.engine).record_results(job_id, "run-1", results)
    job = api.job(job_id)
    assert job["status"] == "cancelled" and job["completed_at"] is not None
    assert job["metadata"]["num_finished"] == "1" and "cancel_requested_at" in job["metadata"]
    assert job_id in _listed(api, "cancelled") and job_id not in _listed(api, "running")
    response = _resume(api, job_id)
    assert response.status_code == 200, response.text
    assert (
        response.json()["job"]["status"] == "queued" and "cancel_requested_at" not in response.json()["job"]["metadata"]
    )


@pytest.mark.slow  # waits out keep_partial_results' retry delays (2 x 5 s)
def test_a_job_whose_partial_output_could_not_be_written_reads_cancelled_once_the_merge_gives_up(
    deployment_factory, tmp_path
):
    """keep_partial_results failing for good (its output's directory is a file here) must not leave the job
    reading running for ever: giving up records the reason, and the job has stopped."""
    import dagster as dg

    from batch_pipeline.pipeline.partial_results import keep_partial_results, partial_results_run_request
    from batch_pipeline.pipeline.resources import JobStorage
    from tests.api_fixtures import sensor_resources

    api = deployment_factory()
    (tmp_path / "out").write_text("a file where the output's directory should be")
    job_id = api.client.post("/v2/batch-completions", json=_body(tmp_path), headers=ALICE).json()["job_id"]
    stopped = api.instance.add_run(dg.DagsterRun(job_name="batch_completions", status=dg.DagsterRunStatus.CANCELED))
    assert api.store.mark_started(job_id, stopped.run_id)
    shard = Path(JobStorage(work_dir_base=settings().work_dir_base).work_dir(job_id)) / "shards" / "000"
    shard.mkdir(parents=True)
    (shard / "input.jsonl").write_text('{"index": 0, "kind": "v1", "request": {}}\n')
    ShardProgressStore(engine=api.store.engine).record_shards(job_id, {0: 1})
    api.store.mark_cancelled(job_id)
    held = api.store.mark_run_ended(
        job_id, stopped.run_id, JobStatus.CANCELLED, datetime.now(UTC), keeping_partial_results=True
    )
    merge = partial_results_run_request(api.store.get(job_id), stopped.run_id, "cancelled", "cancelled", held)
    assert api.job(job_id)["status"] == "running"

    result = keep_partial_results.execute_in_process(
        run_config=merge.run_config,
        tags=merge.tags,
        instance=api.instance,
        resources=sensor_resources(
            str(api.store.engine.url), job_storage=JobStorage(work_dir_base=settings().work_dir_base)
        ),
        raise_on_error=False,
    )
    assert not result.success
    job = api.job(job_id)
    assert job["status"] == "cancelled" and "num_finished" not in job["metadata"]


@pytest.mark.slow
def test_a_batch_cancelled_while_generating_reads_cancelled_only_with_its_output_and_resumes_at_once(tmp_path):
    """Through `serve` (the API, the daemon, real vLLM): from the cancel until the job reads cancelled it
    reads running and its OpenAI batch cancelling; it never reads cancelled before its partial output is
    written; a resume right then is accepted. The times taken are printed (issue 46's figures)."""
    import openai.types

    from tests.entrypoints.test_serve import Served
    from tests.openai_batch.test_openai_batch import _jsonl, _line

    served = Served(tmp_path)
    try:
        served.wait_until_up()
        client = httpx.Client(base_url=served.api, timeout=60)
        short = [_line(f"short-{i}", f"Short {i}:", max_tokens=2, temperature=0) for i in range(8)]
        long = [_line(f"long-{i}", f"Long {i}:", max_tokens=3000, ignore_eos=True, temperature=0) for i in range(8)]
        upload = client.post(
            "/v1/files",
            data={"purpose": "batch"},
            files={"file": ("in.jsonl", _jsonl(short + long), "application/jsonl")},
        )
        body = {"input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        batch_id = client.post("/v1/batches", json=body).json()["id"]

        def job() -> dict:
            return client.get(f"/v2/batch-completions/{batch_id}").json()["job"]

        deadline = time.monotonic() + 1200
        while int(job()["metadata"].get("requests_done", "0")) < 8:  # the short ones done, the long ones generating
            assert time.monotonic() < deadline, job()
            time.sleep(1)
        cancelled_at = time.monotonic()
        assert client.post(f"/v1/batches/{batch_id}/cancel").json()["status"] == "cancelling"
        seen: list[tuple[float, str, str]] = []
        while True:
            batch = client.get(f"/v1/batches/{batch_id}").json()
            openai.types.Batch.model_validate(batch)  # the SDK's type reads every status it is given
            current = job()
            seen.append((round(time.monotonic() - cancelled_at, 1), current["status"], batch["status"]))
            if current["status"] == "cancelled":
                break
            assert current["status"] == "running" and "cancel_requested_at" in current["metadata"], seen
            assert batch["status"] == "cancelling" and batch["output_file_id"] is None, seen
            assert time.monotonic() - cancelled_at < 300, seen
            time.sleep(0.2)
        resumed = client.post(f"/v2/batch-completions/{batch_id}/actions/resume")
        resumed_after = round(time.monotonic() - cancelled_at, 1)
        # Read as it read cancelled: its partial output was written by then.
        assert current["metadata"]["num_finished"] == "8" and current["completed_at"] is not None, current
        assert batch["status"] == "cancelled" and batch["output_file_id"] and batch["error_file_id"], batch
        assert resumed.status_code == 200, resumed.text
        print(f"\ncancel -> reads cancelled, output written: {seen[-1][0]} s; resume accepted: {resumed_after} s")
        # A normal cancel printed some 150 lines of stack traces on serve's console (issue 46): each event it
        # causes is one line now (the run's event log keeps the traces).
        console = served.log.read_text(errors="replace")
        assert "RUN_CANCELED" in console and "(interrupted: the run was cancelled)" in console
        assert "Stack Trace" not in console and "Traceback" not in console, console[-4000:]
        first_seen = {(status, batch_status): at for at, status, batch_status in reversed(seen)}
        print("first seen (job, batch) -> s after cancel:", first_seen)
    finally:
        served.kill()
