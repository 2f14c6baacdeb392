"""A cancelled job reads `cancelled` only once it has stopped: its run ended and the results its shards
finished are in its output. Until then it reads as it did (Scale's statuses have no `cancelling`), says
when the cancel was asked, and an OpenAI batch says `cancelling`. Fast tests over the API, a real Dagster
instance and job store (no daemon); the slow one cancels a real job through `serve`."""

from datetime import UTC, datetime
from pathlib import Path

from batch_pipeline.store.results import JobResults
from batch_pipeline.store.schema import JobStatus
from tests.api_fixtures import USER_KEY
from tests.test_api import _body

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
    api.store.record_shards(job_id, {0: 2})
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
    api.store.record_results(job_id, "run-1", results)
    job = api.job(job_id)
    assert job["status"] == "cancelled" and job["completed_at"] is not None
    assert job["metadata"]["num_finished"] == "1" and "cancel_requested_at" in job["metadata"]
    assert job_id in _listed(api, "cancelled") and job_id not in _listed(api, "running")
    response = _resume(api, job_id)
    assert response.status_code == 200, response.text
    assert (
        response.json()["job"]["status"] == "queued" and "cancel_requested_at" not in response.json()["job"]["metadata"]
    )


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
    shard = Path(JobStorage().work_dir(job_id)) / "shards" / "000"
    shard.mkdir(parents=True)
    (shard / "input.jsonl").write_text('{"index": 0, "kind": "v1", "request": {}}\n')
    api.store.record_shards(job_id, {0: 1})
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
        resources=sensor_resources(str(api.store.engine.url), job_storage=JobStorage()),
        raise_on_error=False,
    )
    assert not result.success
    job = api.job(job_id)
    assert job["status"] == "cancelled" and "num_finished" not in job["metadata"]
