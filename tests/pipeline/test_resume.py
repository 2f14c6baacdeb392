"""`POST /v2/batch-completions/{job_id}/actions/resume`: a failed, cancelled or expired job runs again on the
requests it has no result for. Fast tests of who may resume what, and when (the API over a real Dagster
instance and job store, no daemon); `test_resume_e2e` resumes a real job through `serve`."""

import hashlib
import json
import shutil
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
import pytest

from batch_pipeline.core.settings import settings
from batch_pipeline.pipeline import step_server
from batch_pipeline.pipeline.runs import launch_key
from batch_pipeline.pipeline.sensors import run_request_for
from batch_pipeline.pipeline.tags import RESUME_TAG
from batch_pipeline.shards.merge import checkpointed
from batch_pipeline.store import retention
from batch_pipeline.store.progress import ShardProgressStore
from batch_pipeline.store.schema import JobStatus
from batch_pipeline.store.webhooks import WebhookOutbox
from tests.api.test_api import _body, _sensor_run_requests
from tests.api_fixtures import ADMIN_KEY, OTHER_KEY, USER_KEY

ALICE = {"x-api-key": USER_KEY}
BOB = {"x-api-key": OTHER_KEY}


def _resume(api, job_id: str, headers=ALICE, key: str | None = None):
    headers = {**headers, **({"Idempotency-Key": key} if key is not None else {})}
    return api.client.post(f"/v2/batch-completions/{job_id}/actions/resume", headers=headers)


def _cancelled_job(api, tmp_path, name: str = "out", **fields) -> str:
    """A job cancelled before any run of it (no daemon here): cancelled, its end recorded."""
    job_id = api.client.post("/v2/batch-completions", json=_body(tmp_path, name, **fields), headers=ALICE).json()[
        "job_id"
    ]
    assert api.client.post(f"/v2/batch-completions/{job_id}/actions/cancel", headers=ALICE).json() == {"success": True}
    return job_id


def test_a_cancelled_job_is_resumed_as_the_same_job_queued_again_with_a_renewed_deadline(deployment_factory, tmp_path):
    api = deployment_factory()
    job_id = _cancelled_job(api, tmp_path, max_runtime_sec=3600)
    before = api.job(job_id)

    response = _resume(api, job_id)
    assert response.status_code == 200, response.text
    job = response.json()["job"]
    assert job["job_id"] == job_id and job["status"] == "queued"
    assert job["output_data_path"] == before["output_data_path"]
    assert job["completed_at"] is None  # its last end is not its end any more
    assert datetime.fromisoformat(job["expires_at"]) > datetime.fromisoformat(before["expires_at"])
    metadata = job["metadata"]
    assert (metadata["resumed_from"], metadata["resume_count"]) == ("cancelled", "1")
    assert all(isinstance(value, str) for value in metadata.values())
    assert api.job(job_id)["metadata"]["resumed_from"] == "cancelled"  # GET says so too

    # The jobs sensor gives it a run of its own: a new run key (one run per resume) and the resume's tag.
    (request,) = _sensor_run_requests(api)
    assert request.run_key == f"{job_id}:resume-1" and request.tags[RESUME_TAG] == "1"
    assert float(request.tags["batch_pipeline/deadline"]) == datetime.fromisoformat(job["expires_at"]).timestamp()

    # Cancelled again while it waits for that run, it can be resumed again.
    assert api.client.post(f"/v2/batch-completions/{job_id}/actions/cancel", headers=ALICE).json() == {"success": True}
    assert api.job(job_id)["status"] == "cancelled"
    again = _resume(api, job_id).json()["job"]
    assert again["metadata"]["resume_count"] == "2"
    assert run_request_for(api.store.get(job_id), None, launch_key(api.instance)).run_key == f"{job_id}:resume-2"


@pytest.mark.parametrize("status", ["queued", "running", "completed"])
def test_a_job_that_is_queued_running_or_completed_is_a_409_naming_its_status(deployment_factory, tmp_path, status):
    api = deployment_factory()
    job_id = api.client.post("/v2/batch-completions", json=_body(tmp_path), headers=ALICE).json()["job_id"]
    if status != "queued":
        assert api.store.mark_started(job_id, "run-1")
    if status == "completed":
        api.store.mark_run_ended(job_id, "run-1", JobStatus.COMPLETED, datetime.now().astimezone())
    assert api.job(job_id)["status"] == status

    response = _resume(api, job_id)
    assert response.status_code == 409
    assert f"the job is {status}" in response.json()["detail"]
    assert api.job(job_id)["status"] == status and "resumed_from" not in api.job(job_id)["metadata"]


def test_a_cancelled_job_whose_run_is_still_stopping_is_a_409(deployment_factory, tmp_path):
    api = deployment_factory()
    job_id = api.client.post("/v2/batch-completions", json=_body(tmp_path), headers=ALICE).json()["job_id"]
    api.store.mark_started(job_id, "run-1")
    api.store.mark_cancelled(job_id)  # asked to stop; the run's end not recorded yet
    response = _resume(api, job_id)
    assert response.status_code == 409 and "still stopping" in response.json()["detail"]


def test_a_stopped_jobs_resume_waits_for_its_partial_results_output_and_not_for_the_merge_runs_end(
    deployment_factory, tmp_path
):
    """GET shows `num_finished` once keep_partial_results has recorded the output, a moment before its run
    ends: a resume then was a 409 (the resume e2e failed on it in CI). The output being final is what counts."""
    from batch_pipeline.pipeline.partial_results import keep_partial_results, partial_results_run_request
    from batch_pipeline.store.results import JobResults

    api = deployment_factory()
    job_id = api.client.post("/v2/batch-completions", json=_body(tmp_path), headers=ALICE).json()["job_id"]
    assert api.store.mark_started(job_id, "run-1")
    api.store.mark_cancelled(job_id)
    api.store.mark_run_ended(job_id, "run-1", JobStatus.CANCELLED, datetime.now(UTC), keeping_partial_results=True)
    merge = partial_results_run_request(api.store.get(job_id), "run-1", "cancelled", "the job was cancelled")
    assert merge is None  # no shards planned: nothing to merge, nothing to wait for
    ShardProgressStore(engine=api.store.engine).record_shards(job_id, {0: 2})
    (Path(api.service.job_storage.work_dir(job_id)) / "shards" / "000").mkdir(parents=True)
    merge = partial_results_run_request(api.store.get(job_id), "run-1", "cancelled", "the job was cancelled")
    api.instance.create_run_for_job(
        keep_partial_results, run_config=merge.run_config, tags=merge.tags, status=dg.DagsterRunStatus.STARTED
    )

    response = _resume(api, job_id)  # the job reads running until then (tests/pipeline/test_cancel.py)
    assert response.status_code == 409 and "still stopping" in response.json()["detail"]

    results = JobResults(job_id=job_id, dagster_run_id="run-1", status="cancelled", num_requests=2, num_finished=1)
    ShardProgressStore(engine=api.store.engine).record_results(job_id, "run-1", results)
    assert api.job(job_id)["metadata"]["num_finished"] == "1"  # what the user waits for
    response = _resume(api, job_id)
    assert response.status_code == 200, response.text
    assert response.json()["job"]["status"] == "queued"


def test_the_merge_of_a_stopped_runs_results_run_again_writes_nothing_once_they_are_kept(deployment_factory, tmp_path):
    """Resume waits only until the kept results are recorded; a retry of the merge step after that (a call
    after `record_results` failed) rewrote the output and the batch files under a job resumed meanwhile."""
    from batch_pipeline.pipeline.partial_results import keep_partial_results, partial_results_run_request
    from batch_pipeline.pipeline.resources import JobStorage
    from tests.api_fixtures import sensor_resources

    api = deployment_factory()
    output = tmp_path / "out" / "output.json"
    job_id = api.client.post("/v2/batch-completions", json=_body(tmp_path), headers=ALICE).json()["job_id"]
    stopped = api.instance.add_run(dg.DagsterRun(job_name="batch_completions", status=dg.DagsterRunStatus.CANCELED))
    assert api.store.mark_started(job_id, stopped.run_id)
    shard = Path(JobStorage(work_dir_base=settings().work_dir_base).work_dir(job_id)) / "shards" / "000"
    shard.mkdir(parents=True)
    (shard / "input.jsonl").write_text(
        "".join(json.dumps({"index": i, "kind": "v1", "request": {}}) + "\n" for i in (0, 1))
    )
    (shard / "results.tsv").write_text(f"0\t{json.dumps({'text': 'kept'})}\n")
    ShardProgressStore(engine=api.store.engine).record_shards(job_id, {0: 2})
    api.store.mark_cancelled(job_id)
    held = api.store.mark_run_ended(
        job_id, stopped.run_id, JobStatus.CANCELLED, datetime.now(UTC), keeping_partial_results=True
    )
    merge = partial_results_run_request(api.store.get(job_id), stopped.run_id, "cancelled", "cancelled", held)

    def run_merge() -> dg.ExecuteInProcessResult:
        return keep_partial_results.execute_in_process(
            run_config=merge.run_config,
            tags=merge.tags,
            instance=api.instance,
            resources=sensor_resources(
                str(api.store.engine.url), job_storage=JobStorage(work_dir_base=settings().work_dir_base)
            ),
        )

    assert run_merge().success
    kept = json.loads(output.read_text())
    assert kept[0] == {"text": "kept"} and kept[1]["error"]["code"] == "cancelled"
    assert api.job(job_id)["metadata"]["num_finished"] == "1"
    # Beside it, the summary the job's row keeps: a job never resumed has no resume figures.
    assert json.loads(Path(f"{output}.metadata.json").read_text()) == {
        "job_id": job_id,
        "dagster_run_id": stopped.run_id,
        "status": "cancelled",
        "num_requests": 2,
        "num_finished": 1,
        "num_unfinished": 1,
        "reason": "cancelled",
    }
    output.write_text("what a resumed run wrote")  # the output is the resumed run's now
    assert run_merge().success  # the step run again, as its retry would be
    assert output.read_text() == "what a resumed run wrote"
    assert _resume(api, job_id).status_code == 200


def test_a_resumed_job_stopped_again_keeps_its_resume_figures_in_its_metadata_file(deployment_factory, tmp_path):
    """The file beside a stopped run's partial output has the figures GET shows of a resumed job, as numbers:
    what its checkpoints kept, and the requests generated since (its tokens are counted once it completes)."""
    from batch_pipeline.pipeline.partial_results import keep_partial_results, partial_results_run_request
    from batch_pipeline.pipeline.resources import JobStorage
    from tests.api_fixtures import sensor_resources

    api = deployment_factory()
    output = tmp_path / "out" / "output.json"
    job_id = _cancelled_job(api, tmp_path)
    assert _resume(api, job_id).status_code == 200
    run = api.instance.add_run(dg.DagsterRun(job_name="batch_completions", status=dg.DagsterRunStatus.CANCELED))
    assert api.store.mark_started(job_id, run.run_id)
    shard = Path(JobStorage(work_dir_base=settings().work_dir_base).work_dir(job_id)) / "shards" / "000"
    shard.mkdir(parents=True)
    (shard / "input.jsonl").write_text(
        "".join(json.dumps({"index": i, "kind": "v1", "request": {}}) + "\n" for i in (0, 1, 2))
    )
    (shard / "results.tsv").write_text("".join(f"{i}\t{json.dumps({'text': 'kept'})}\n" for i in (0, 1)))
    ShardProgressStore(engine=api.store.engine).record_shards(job_id, {0: 3})
    assert ShardProgressStore(engine=api.store.engine).record_kept(
        job_id, 1, 4, 5
    )  # one result was the checkpoint's when the run planned
    api.store.mark_cancelled(job_id)
    held = api.store.mark_run_ended(
        job_id, run.run_id, JobStatus.CANCELLED, datetime.now(UTC), keeping_partial_results=True
    )
    merge = partial_results_run_request(api.store.get(job_id), run.run_id, "cancelled", "cancelled", held)
    assert keep_partial_results.execute_in_process(
        run_config=merge.run_config,
        tags=merge.tags,
        instance=api.instance,
        resources=sensor_resources(
            str(api.store.engine.url), job_storage=JobStorage(work_dir_base=settings().work_dir_base)
        ),
    ).success

    written = json.loads(Path(f"{output}.metadata.json").read_text())
    assert (written["num_requests"], written["num_finished"], written["num_unfinished"]) == (3, 2, 1)
    assert written["resumed_from"] == "cancelled" and "resumed_from_run_id" in written
    assert (written["resume_requests_kept"], written["resume_requests_generated"]) == (1, 1)
    assert written["resume_completion_tokens_kept"] == 5 and "resume_completion_tokens_generated" not in written


def test_a_job_whose_checkpoints_are_gone_is_a_409_saying_so(deployment_factory, tmp_path):
    api = deployment_factory()
    job_id = api.client.post("/v2/batch-completions", json=_body(tmp_path), headers=ALICE).json()["job_id"]
    ShardProgressStore(engine=api.store.engine).record_shards(
        job_id, {0: 1}
    )  # it had planned a shard, whose directory is not there
    assert api.client.post(f"/v2/batch-completions/{job_id}/actions/cancel", headers=ALICE).json() == {"success": True}
    response = _resume(api, job_id)
    assert response.status_code == 409
    assert "the job's checkpoints were deleted" in response.json()["detail"]


def test_a_job_whose_work_dir_retention_deleted_is_a_409_saying_when(deployment_factory, tmp_path):
    api = deployment_factory()
    job_id = _cancelled_job(api, tmp_path)
    # What the cleanup job does first to a job past its retention: mark the row, then delete the work dir.
    assert retention.claim_work_dir(
        api.store.engine, job_id, datetime.now(UTC) + timedelta(seconds=1), datetime.now(UTC)
    )
    deleted = retention.work_dir_deleted_at(api.store.engine, job_id)
    response = _resume(api, job_id)
    assert response.status_code == 409
    assert response.json()["detail"].startswith(f"the checkpoints were deleted on {deleted:%Y-%m-%d %H:%M:%S} UTC")
    # And the store's own condition refuses it, for a cleanup between the route's read and its write.
    assert not api.store.resume(api.store.get(job_id), "cancelled", None, 3600)
    assert api.job(job_id)["status"] == "cancelled"


def test_another_teams_job_is_a_404_as_get_is_and_an_admin_may_resume_it(deployment_factory, tmp_path):
    api = deployment_factory()
    job_id = _cancelled_job(api, tmp_path)
    assert api.client.get(f"/v2/batch-completions/{job_id}", headers=BOB).status_code == 404
    response = _resume(api, job_id, headers=BOB)
    assert response.status_code == 404 and response.json()["detail"] == f"no batch job '{job_id}'"
    assert api.job(job_id)["status"] == "cancelled"  # untouched
    assert _resume(api, "batch-" + "x" * 500).status_code == 404  # no such job, however long the id
    assert _resume(api, job_id, headers={}).status_code == 401  # keys are configured: none sent
    assert _resume(api, job_id, headers={"x-api-key": "wrong"}).status_code == 401
    assert _resume(api, job_id, headers={"x-api-key": ADMIN_KEY}).json()["job"]["status"] == "queued"


def test_a_resume_repeated_with_its_idempotency_key_is_answered_again_and_without_it_is_a_409(
    deployment_factory, tmp_path
):
    api = deployment_factory()
    job_id = _cancelled_job(api, tmp_path)
    first = _resume(api, job_id, key="resume-once")
    assert first.status_code == 200
    repeated = _resume(api, job_id, key="resume-once")
    assert repeated.status_code == 200 and repeated.json() == first.json()  # resumed once, not twice
    assert api.store.get(job_id).resume_count == 1
    without_key = _resume(api, job_id)
    assert without_key.status_code == 409 and "the job is queued" in without_key.json()["detail"]
    another_key = _resume(api, job_id, key="resume-twice")
    assert another_key.status_code == 409
    assert _resume(api, job_id, key="").status_code == 422  # as on create: an empty key names the header
    assert len(api.store.list().jobs) == 1


def test_the_kept_figures_are_what_the_checkpoints_hold_whole_lines_only(tmp_path):
    shard = tmp_path / "shards" / "000"
    shard.mkdir(parents=True)
    (shard / "results.tsv").write_text(
        '0\t{"text": "a", "num_prompt_tokens": 3, "num_completion_tokens": 5}\n'
        '2\t{"id": "x-2", "usage": {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}}\n'
        '3\t{"error": {"code": "invalid_request", "message": "m", "type": "invalid_request_error", "param": null}}\n'
        '4\t{"text": "torn'  # a killed worker's last line: no result
    )
    (tmp_path / "shards" / "001").mkdir()  # a shard that finished nothing
    kept = checkpointed(str(tmp_path))
    assert (kept.requests, kept.prompt_tokens, kept.completion_tokens) == (3, 7, 11)


def test_an_openai_batch_cancelled_before_launch_is_resumed_through_the_same_route(
    deployment_factory, tmp_path, monkeypatch
):
    from tests.openai_batch.test_openai_batch import _bearer, _create, _jsonl, _line, _upload

    monkeypatch.setenv("BATCH_PIPELINE_DATA_ROOTS", str(tmp_path / "data"))
    api = deployment_factory()
    client = api.client
    file_id = _upload(client, _jsonl([_line(f"req-{i}", f"prompt {i}") for i in range(3)])).json()["id"]
    batch_id = _create(client, file_id).json()["id"]
    assert client.post(f"/v1/batches/{batch_id}/cancel", headers=_bearer(USER_KEY)).json()["status"] == "cancelled"

    response = _resume(api, batch_id)
    assert response.status_code == 200, response.text
    assert response.json()["job"]["metadata"]["resumed_from"] == "cancelled"
    batch = client.get(f"/v1/batches/{batch_id}", headers=_bearer(USER_KEY)).json()
    assert batch["status"] == "in_progress"
    (request,) = _sensor_run_requests(api)
    assert request.run_key == f"{batch_id}:resume-1"


@pytest.mark.slow
def test_an_openai_batch_cancelled_while_running_then_resumed_rewrites_its_files_whole(
    deployment_factory, tmp_path, monkeypatch
):
    from tests.openai_batch.test_openai_batch import _bearer, _create, _jsonl, _line, _upload

    monkeypatch.setenv("BATCH_PIPELINE_DATA_ROOTS", str(tmp_path / "data"))
    api = deployment_factory()
    api.start_daemon()
    client = api.client
    short = [_line(f"short-{i}", f"Short {i}:", max_tokens=2, temperature=0) for i in range(8)]
    long = [_line(f"long-{i}", f"Long {i}:", max_tokens=400, ignore_eos=True, temperature=0) for i in range(8)]
    batch_id = _create(client, _upload(client, _jsonl(short + long)).json()["id"]).json()["id"]
    api.wait_for(batch_id, lambda j: int(j["metadata"].get("requests_done", "0")) >= 8, timeout=600)
    client.post(f"/v1/batches/{batch_id}/cancel", headers=_bearer(USER_KEY))
    deadline = time.monotonic() + 300
    while (batch := client.get(f"/v1/batches/{batch_id}", headers=_bearer(USER_KEY)).json())["status"] != "cancelled":
        assert time.monotonic() < deadline, batch
        time.sleep(1)
    assert batch["error_file_id"] is not None  # the long ones, unfinished
    stale_files = {batch["output_file_id"], batch["error_file_id"]}

    while (response := _resume(api, batch_id)).status_code == 409:  # its partial results still being kept
        assert "still" in response.json()["detail"] and time.monotonic() < deadline, response.text
        time.sleep(1)
    assert response.status_code == 200, response.text
    job = api.wait_for(batch_id, lambda j: j["status"] in ("completed", "failed", "cancelled"), timeout=900)
    assert job["status"] == "completed", job
    while (batch := client.get(f"/v1/batches/{batch_id}", headers=_bearer(USER_KEY)).json())["status"] != "completed":
        assert time.monotonic() < deadline + 900, batch
        time.sleep(1)
    assert batch["request_counts"] == {"total": 16, "completed": 16, "failed": 0}
    assert batch["error_file_id"] is None and batch["output_file_id"] not in stale_files
    text = client.get(f"/v1/files/{batch['output_file_id']}/content", headers=_bearer(USER_KEY)).text
    lines = [json.loads(line) for line in text.splitlines()]
    assert sorted(line["custom_id"] for line in lines) == sorted(
        [f"short-{i}" for i in range(8)] + [f"long-{i}" for i in range(8)]
    )
    assert all(line["response"]["status_code"] == 200 for line in lines)
    for stale in stale_files - {None}:  # the partial files it replaced are gone
        assert client.get(f"/v1/files/{stale}", headers=_bearer(USER_KEY)).status_code == 404
    metadata = job["metadata"]
    assert int(metadata["resume_requests_kept"]) >= 8
    assert int(metadata["resume_requests_kept"]) + int(metadata["resume_requests_generated"]) == 16


def _failed_after_a_run(api, tmp_path, name: str = "out") -> str:
    """A job whose run started and failed, its end recorded (as the run-status sensor records it)."""
    job_id = api.client.post("/v2/batch-completions", json=_body(tmp_path, name), headers=ALICE).json()["job_id"]
    assert api.store.mark_started(job_id, "run-1")
    api.store.mark_run_ended(job_id, "run-1", JobStatus.FAILED, datetime.now(UTC), "a shard failed")
    return job_id


def test_a_resumed_job_cancelled_before_its_new_run_starts_never_runs(deployment_factory, tmp_path):
    """Its first start is kept in the row: the guard that a job cancelled before its run started refuses
    to start read that start, and the cancel answered success while the resume's run generated anyway."""
    api = deployment_factory()
    job_id = _failed_after_a_run(api, tmp_path)
    assert _resume(api, job_id).status_code == 200
    # The jobs sensor asked for the resume's run; the user cancels before the daemon starts it.
    assert api.client.post(f"/v2/batch-completions/{job_id}/actions/cancel", headers=ALICE).json() == {"success": True}
    assert not api.store.mark_started(job_id, "run-2")
    assert api.job(job_id)["status"] == "cancelled"


def test_a_resumed_jobs_new_end_is_announced_even_if_its_run_never_started(deployment_factory, tmp_path):
    """Its previous end stays in the row until a run of it starts: a run failed before starting (at launch,
    its code location unreachable) ended the job again with no webhook event."""
    api = deployment_factory()
    job_id = _failed_after_a_run(api, tmp_path)
    assert _resume(api, job_id).status_code == 200
    api.store.link_run(job_id, "run-2")
    api.store.mark_run_ended(job_id, "run-2", JobStatus.FAILED, datetime.now(UTC), "the code location was down")
    assert api.job(job_id)["status"] == "failed"
    events = WebhookOutbox(engine=api.store.engine).events_of_job(job_id)
    assert [event.type for event in events] == ["job.failed", "job.failed"]


def test_a_resume_is_not_undone_by_the_late_end_of_the_run_it_resumed_from(deployment_factory, tmp_path):
    """Resumed, its new run cancelled while queued: resumed again before that run's end was recorded, the
    late record flipped the job back to cancelled with the old run, and it was never launched."""
    api = deployment_factory()
    job_id = _failed_after_a_run(api, tmp_path)
    assert _resume(api, job_id).status_code == 200
    api.store.link_run(job_id, "run-2")
    api.store.mark_cancelled(job_id)  # asked to stop; run-2's end not recorded yet
    response = _resume(api, job_id)
    assert response.status_code == 409 and "still stopping" in response.json()["detail"]

    api.store.mark_run_ended(job_id, "run-2", JobStatus.CANCELLED, datetime.now(UTC))
    assert _resume(api, job_id).status_code == 200
    api.store.mark_run_ended(job_id, "run-2", JobStatus.CANCELLED, datetime.now(UTC))  # recorded again, late
    job = api.store.get(job_id)
    assert (job.status, job.run_id, job.resume_count) == (JobStatus.QUEUED, None, 2)


def _run(api, job_id: str, whole: bool = False) -> dg.JobExecutionResult:
    """The run the jobs sensor asks for the job, executed on the deployment's instance: its first two ops
    (validate_input, plan_shards), or `whole`."""
    from batch_pipeline.pipeline.definitions import batch_completions_job

    request = run_request_for(api.store.get(job_id), None, launch_key(api.instance))
    return dg.execute_job(
        dg.reconstructable(batch_completions_job),
        instance=api.instance,
        run_config=request.run_config,
        tags=request.tags,
        op_selection=None if whole else ["validate_input", "plan_shards"],
        raise_on_error=False,
    )


def _shard_items(work_dir: Path) -> dict[str, list[int]]:
    """The request indices each shard's input holds, by shard directory."""
    return {
        shard.name: [json.loads(line)["index"] for line in (shard / "input.jsonl").read_text().splitlines()]
        for shard in sorted((work_dir / "shards").iterdir())
    }


def _planned_job(api, body: dict) -> tuple[str, dg.JobExecutionResult, Path, dict[str, list[int]]]:
    """A job of `body` submitted and its first run's planning done: its id, that run, its work dir and what
    each shard holds."""
    job_id = api.client.post("/v2/batch-completions", json=body, headers=ALICE).json()["job_id"]
    first = _run(api, job_id)
    assert first.success
    work_dir = Path(api.service.job_storage.work_dir(job_id))
    return job_id, first, work_dir, _shard_items(work_dir)


@pytest.mark.slow  # three runs' steps in step processes, their server restarted for the new settings
def test_a_resumed_job_keeps_the_shard_plan_of_its_first_run_whatever_the_settings_say_now(
    deployment_factory, tmp_path, monkeypatch
):
    """Found by review (issue 28): a resume planned the job's shards again from the day's settings, so with
    BATCH_PIPELINE_MAX_SHARDS_PER_JOB or _MIN_SHARD_TOKENS changed since it stopped, its checkpoints no
    longer lined up with its shards: results generated again, or in a shard that did not own them."""
    monkeypatch.setenv("BATCH_PIPELINE_MAX_SHARDS_PER_JOB", "2")
    monkeypatch.setenv("BATCH_PIPELINE_MIN_SHARD_TOKENS", "0")
    api = deployment_factory()
    content = {"prompts": [f"Prompt {i}" for i in range(6)], "max_new_tokens": 4, "temperature": 0.0}
    body = _body(tmp_path, data_parallelism=2, content=content)
    job_id, first, work_dir, planned = _planned_job(api, body)
    assert len(planned) == 2 and sorted(index for items in planned.values() for index in items) == list(range(6))
    # What its shard workers left before the run failed: every result in the checkpoint of its shard.
    for shard, indices in planned.items():
        results = [{"text": f"kept {i}", "num_prompt_tokens": 2, "num_completion_tokens": 1} for i in indices]
        lines = "".join(f"{i}\t{json.dumps(result)}\n" for i, result in zip(indices, results, strict=True))
        (work_dir / "shards" / shard / "results.tsv").write_text(lines)
    api.store.mark_run_ended(job_id, first.run_id, JobStatus.FAILED, datetime.now(UTC), "a shard failed")
    assert _resume(api, job_id).status_code == 200

    # The deployment's shard settings changed since: either alone would plan this job in one shard now.
    monkeypatch.setenv("BATCH_PIPELINE_MAX_SHARDS_PER_JOB", "1")
    monkeypatch.setenv("BATCH_PIPELINE_MIN_SHARD_TOKENS", str(10**9))
    step_server.stop()  # the resume's run's steps start with them
    resumed = _run(api, job_id)
    assert resumed.success
    assert _shard_items(work_dir) == planned
    assert api.store.get(job_id).requests_kept == 6

    # The whole run generates nothing: every result is the one its checkpoint kept, once, in input order.
    done = _run(api, job_id, whole=True)
    assert done.success
    output = json.loads(Path(body["output_data_path"]).read_text())
    assert [entry["text"] for entry in output] == [f"kept {i}" for i in range(6)]
    metadata = json.loads(Path(body["output_data_path"] + ".metadata.json").read_text())
    assert metadata["data_parallelism"] == {"requested": 2, "used": 2, "reason": None} and len(metadata["shards"]) == 2
    assert sum(shard["generated"] for shard in metadata["shards"]) == 0 and metadata["resume_requests_generated"] == 0


QUEUE_KEY = "key-of-the-queued-team"


@pytest.fixture
def one_queued_job(tmp_path, monkeypatch):
    """A team that may have one job waiting to start (`max_queued_jobs: 1`); its data root."""
    root = tmp_path / "team-q"
    root.mkdir()
    tenants_file = tmp_path / "tenants.yaml"
    tenants_file.write_text(
        "tenants:\n"
        "  team-q:\n"
        f"    api_keys_sha256: [{hashlib.sha256(QUEUE_KEY.encode()).hexdigest()}]\n"
        f"    data_roots: [{root}]\n"
        "    max_queued_jobs: 1\n"
    )
    monkeypatch.setenv("BATCH_PIPELINE_TENANTS", str(tenants_file))
    return root


def test_a_resume_past_the_teams_max_queued_jobs_is_a_429_naming_it_and_resumes_nothing(one_queued_job, tenants_api):
    """Found by review (issue 28): a resume queues the job again, and it was never held to the team's
    max_queued_jobs, as a submission is: a team at its quota queued as many stopped jobs as it liked."""
    api, team = tenants_api, {"x-api-key": QUEUE_KEY}

    def submit(name: str) -> str:
        response = api.post("/v2/batch-completions", json=_body(one_queued_job, name), headers=team)
        assert response.status_code == 200, response.text
        return response.json()["job_id"]

    stopped = submit("stopped")
    assert api.post(f"/v2/batch-completions/{stopped}/actions/cancel", headers=team).json() == {"success": True}
    waiting = submit("waiting")  # the team's one queued job

    refused = api.post(f"/v2/batch-completions/{stopped}/actions/resume", headers=team)
    assert refused.status_code == 429, refused.text
    detail = refused.json()["detail"]
    assert detail.startswith("max_queued_jobs: your team has 1 jobs waiting to start, its quota of 1"), detail
    assert refused.headers["retry-after"] == "30"
    job = api.get(f"/v2/batch-completions/{stopped}", headers=team).json()["job"]
    assert job["status"] == "cancelled" and "resumed_from" not in job["metadata"]

    # Once the waiting one no longer waits, the resume is taken.
    assert api.post(f"/v2/batch-completions/{waiting}/actions/cancel", headers=team).json() == {"success": True}
    resumed = api.post(f"/v2/batch-completions/{stopped}/actions/resume", headers=team)
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["job"]["status"] == "queued"


@pytest.mark.slow  # two runs' steps in step processes, their server restarted for the new settings
def test_a_job_planned_before_plans_were_kept_resumes_in_the_shards_it_was_planned_in(
    deployment_factory, tmp_path, monkeypatch
):
    """A release that kept no shard plan (before migration 0010) grouped no greedy requests sharing a
    generation: planned again on resume, such a job must not group them now, or its checkpoints would no
    longer line up with its shards."""
    from sqlalchemy import text

    monkeypatch.setenv("BATCH_PIPELINE_MAX_SHARDS_PER_JOB", "2")
    monkeypatch.setenv("BATCH_PIPELINE_MIN_SHARD_TOKENS", "0")
    monkeypatch.setenv("BATCH_PIPELINE_DEDUPLICATE", "0")  # planned as that release did: nothing grouped
    api = deployment_factory()

    def chat(text: str, limit: int) -> dict:
        return {"messages": [{"role": "user", "content": text}], "max_tokens": limit, "temperature": 0}

    content = [chat("Summarise Rome.", limit) for limit in (8, 16, 32, 64)] + [chat(f"Q{i}?", 8) for i in range(4)]
    body = _body(tmp_path, data_parallelism=2, content=content)
    job_id, first, work_dir, planned = _planned_job(api, body)
    assert all(set(items) & {0, 1, 2, 3} for items in planned.values())  # the summaries lie in both shards
    with api.store.engine.begin() as connection:  # as that release left the job: no plan kept
        connection.execute(text("UPDATE batch_jobs SET shard_plan = NULL WHERE job_id = :job"), {"job": job_id})
    api.store.mark_run_ended(job_id, first.run_id, JobStatus.FAILED, datetime.now(UTC), "a shard failed")
    assert _resume(api, job_id).status_code == 200

    monkeypatch.setenv("BATCH_PIPELINE_DEDUPLICATE", "1")
    step_server.stop()  # the resume's run's steps start with it
    assert _run(api, job_id).success
    assert _shard_items(work_dir) == planned


def _results(work_dir: Path) -> dict[int, dict]:
    """The results the job's shard checkpoints hold, by index."""
    return {
        int(index): json.loads(payload)
        for results in sorted(work_dir.glob("shards/*/results.tsv"))
        for index, _, payload in (line.partition("\t") for line in results.read_text().splitlines())
    }


def _planned_prompts(work_dir: Path) -> dict[int, str]:
    """The prompt each request of the job's shards asks, by index: a copy's is its source's."""
    prompts = {}
    for shard in sorted((work_dir / "shards").iterdir()):
        for line in (shard / "input.jsonl").read_text().splitlines():
            item = json.loads(line)
            prompts[item["index"]] = item["request"]["prompt"]
    for copies in sorted(work_dir.glob("shards/*/copies.tsv")):
        for line in copies.read_text().splitlines():
            index, source = map(int, line.split("\t"))
            prompts[index] = prompts[source]
    return dict(sorted(prompts.items()))


def _write_input(path: Path, prompts: list[str]) -> None:
    path.write_text("".join(json.dumps({"prompt": p, "max_tokens": 4, "temperature": 0.0}) + "\n" for p in prompts))


@pytest.mark.slow  # two runs' steps in step processes, their server restarted between
def test_a_resume_after_its_input_file_changed_keeps_no_result_under_a_changed_request(
    deployment_factory, tmp_path, monkeypatch
):
    """Found by an attacker's pass (issue 44): a job resumed after its input file changed kept the old
    prompts' answers under the new prompts ("Paris." for "Two plus two equals"): checkpoints were kept by
    index, whatever request was at that index now. Through the real plan_shards op: each result the
    checkpoints keep answers its request's prompt as the input reads now; the rest are generated again."""
    monkeypatch.setenv("BATCH_PIPELINE_MAX_SHARDS_PER_JOB", "2")
    monkeypatch.setenv("BATCH_PIPELINE_MIN_SHARD_TOKENS", "0")
    api = deployment_factory()
    input_path = tmp_path / "prompts.jsonl"
    before = ["The capital of France is", "The capital of Italy is", "The capital of Italy is", "Water is", "Fire is"]
    _write_input(input_path, before)
    body = _body(tmp_path, data_parallelism=2, input_data_path=str(input_path))
    del body["content"]
    job_id, first, work_dir, _ = _planned_job(api, body)
    assert _planned_prompts(work_dir) == dict(enumerate(before))
    # What its shard workers left before the run failed: an answer to each request, in its shard's checkpoint.
    for shard in sorted((work_dir / "shards").iterdir()):
        copies = (shard / "copies.tsv").read_text().splitlines() if (shard / "copies.tsv").exists() else []
        indices = _shard_items(work_dir)[shard.name] + [int(line.split("\t")[0]) for line in copies]
        answers = {i: {"text": f"answers {before[i]}", "num_completion_tokens": 1} for i in sorted(indices)}
        (shard / "results.tsv").write_text("".join(f"{i}\t{json.dumps(answer)}\n" for i, answer in answers.items()))
    api.store.mark_run_ended(job_id, first.run_id, JobStatus.FAILED, datetime.now(UTC), "a shard failed")
    assert _resume(api, job_id).status_code == 200

    # Rewritten in between: a request changed (the source of a repeat, itself unchanged), one is gone from
    # the end, two more are added.
    after = ["The capital of France is", "Two plus two equals", "The capital of Italy is", "Water is"]
    after += ["Air is", "Earth is"]
    _write_input(input_path, after)
    step_server.stop()  # the resume's run's steps start with it
    assert _run(api, job_id).success

    kept = _results(work_dir)
    assert {index: result["text"] for index, result in kept.items()} == {
        index: f"answers {after[index]}" for index in (0, 2, 3)
    }
    assert api.store.get(job_id).requests_kept == 3
    # The shards ask what the input asks now; the repeat's earlier source changed, so it is no copy of it.
    assert _planned_prompts(work_dir) == dict(enumerate(after))


def _answer_everything(work_dir: Path, prompts: list[str]) -> None:
    """Each shard's checkpoint holds an answer to each of its requests, copies included."""
    for shard in sorted((work_dir / "shards").iterdir()):
        copies = (shard / "copies.tsv").read_text().splitlines() if (shard / "copies.tsv").exists() else []
        indices = _shard_items(work_dir)[shard.name] + [int(line.split("\t")[0]) for line in copies]
        answers = {i: {"text": f"answers {prompts[i]}"} for i in sorted(indices)}
        (shard / "results.tsv").write_text("".join(f"{i}\t{json.dumps(answer)}\n" for i, answer in answers.items()))


def _items(prompts: list[str]):
    from batch_pipeline.shards.records import work_items

    return work_items((f"line {i}", {"prompt": p, "max_tokens": 4, "temperature": 0.0}) for i, p in enumerate(prompts))


def test_shards_written_again_over_a_changed_input_keep_exactly_the_results_of_unchanged_requests(tmp_path):
    from batch_pipeline.shards.planning import write_shards
    from batch_pipeline.shards.replanning import rewrite_shards

    before = ["France", "Italy", "Italy", "Ocean", "Water", "Fire", "Fire"]
    write_shards(_items(before), 2, str(tmp_path), deduplicate=True)
    assert sum(len(_shard_items(tmp_path)[name]) for name in ("000", "001")) == 5  # 2 and 6 are copies
    _answer_everything(tmp_path, before)

    # 1 (a copy's source) changed; 3 changed to repeat 0; 6 (a copy) changed; 7 added at the end.
    after = ["France", "Two plus two", "Italy", "France", "Water", "Fire", "Air", "Sky"]
    rewritten = rewrite_shards(_items(after), 2, str(tmp_path), deduplicate=True)
    assert (rewritten.unchanged, rewritten.changed, rewritten.added, rewritten.removed) == (4, 3, 1, 0)
    assert rewritten.results_dropped == 3
    assert _planned_prompts(tmp_path) == dict(enumerate(after))
    kept = _results(tmp_path)
    assert {i: result["text"] for i, result in kept.items()} == {i: f"answers {after[i]}" for i in (0, 2, 4, 5)}
    assert sum(shard.item_count for shard in rewritten.shards) == len(after)
    assert checkpointed(str(tmp_path)).requests == 4
    # The copy whose source changed still answers its own request: it keeps its result, and is generated
    # where it was should it have none; the changed request that repeats a kept one is a copy of it.
    generated = {index for items in _shard_items(tmp_path).values() for index in items}
    assert {2, 6} <= generated and 3 not in generated
    assert "3\t0\n" in "".join(path.read_text() for path in tmp_path.glob("shards/*/copies.tsv"))

    # Requests gone from the end take their results with them; the same input again changes nothing more.
    rewritten = rewrite_shards(_items(after[:5]), 2, str(tmp_path), deduplicate=True)
    assert (rewritten.unchanged, rewritten.changed, rewritten.added, rewritten.removed) == (5, 0, 0, 3)
    assert {i: result["text"] for i, result in _results(tmp_path).items()} == {
        i: f"answers {after[i]}" for i in (0, 2, 4)
    }
    assert rewrite_shards(_items(after[:5]), 2, str(tmp_path), deduplicate=True).describe() is None
    assert _planned_prompts(tmp_path) == dict(enumerate(after[:5]))


def test_shards_written_again_over_an_unchanged_input_are_the_shards_the_first_plan_wrote(tmp_path):
    from batch_pipeline.shards.planning import write_shards
    from batch_pipeline.shards.replanning import rewrite_shards

    prompts = [f"Prompt {i % 5} " + "word " * (i % 7) for i in range(40)]
    first = write_shards(_items(prompts), 3, str(tmp_path / "first"), deduplicate=True, group_generations=True)
    shutil.copytree(tmp_path / "first", tmp_path / "again")
    _answer_everything(tmp_path / "again", prompts)
    again = rewrite_shards(_items(prompts), 3, str(tmp_path / "again"), deduplicate=True)
    assert again.describe() is None and again.results_dropped == 0
    assert [(s.item_count, s.copy_count, s.prompt_count) for s in again.shards] == [
        (s.item_count, s.copy_count, s.prompt_count) for s in first
    ]
    assert sum(s.copy_count for s in first) > 0
    for name in ("input.jsonl", "copies.tsv"):
        written = {path.parent.name: path.read_text() for path in (tmp_path / "first").glob(f"shards/*/{name}")}
        assert {path.parent.name: path.read_text() for path in (tmp_path / "again").glob(f"shards/*/{name}")} == written
    assert len(_results(tmp_path / "again")) == len(prompts)


def test_shards_written_again_over_an_input_that_fails_midway_are_left_as_they_were(tmp_path):
    """A record that cannot be read, past changed ones: the run fails, and the shards and their checkpoints
    are those of the earlier plan still, with no result dropped and none kept under another request."""
    from batch_pipeline.contract.records import RecordError
    from batch_pipeline.shards.planning import write_shards
    from batch_pipeline.shards.records import work_items
    from batch_pipeline.shards.replanning import rewrite_shards

    before = ["France", "Italy", "Water"]
    write_shards(_items(before), 2, str(tmp_path), deduplicate=True)
    _answer_everything(tmp_path, before)
    files = {path: path.read_text() for path in tmp_path.glob("shards/*/*")}
    records = [("line 0", {"prompt": "Two plus two", "max_tokens": 4, "temperature": 0.0}), ("line 1", {"nope": 1})]
    with pytest.raises(RecordError):
        rewrite_shards(work_items(records), 2, str(tmp_path), deduplicate=True)
    assert {path: path.read_text() for path in tmp_path.glob("shards/*/*")} == files


def test_a_later_run_writes_the_shards_of_the_plan_its_first_run_recorded_whatever_the_settings_say_now(tmp_path):
    from batch_pipeline.shards.planning import PlanningSettings, RecordedPlan
    from batch_pipeline.shards.replanning import write_job_shards

    prompts = [f"Prompt {i % 5} " + "word " * (i % 7) for i in range(40)]
    settings = PlanningSettings(max_shards=None, min_tokens_per_shard=0)
    first = write_job_shards(_items(prompts), str(tmp_path / "job"), None, 3, settings, tool_loop=False)
    assert (first.recorded.plan.used, first.recorded.deduplicate, first.recorded.group_generations) == (3, True, True)
    assert not first.kept and first.input_changes is None and first.copies > 0
    written = {path.relative_to(tmp_path): path.read_text() for path in tmp_path.glob("job/shards/*/*")}

    # Settings now that would plan one shard and no copies: the recorded plan is written again, as it was.
    recorded = RecordedPlan.from_json(first.recorded.to_json())
    now = PlanningSettings(max_shards=1, min_tokens_per_shard=0, deduplicate=False)
    again = write_job_shards(_items(prompts), str(tmp_path / "job"), recorded, 3, now, tool_loop=True)
    assert again.kept and again.recorded == recorded and again.input_changes is None
    assert [(s.shard_index, s.item_count, s.copy_count) for s in again.shards] == [
        (s.shard_index, s.item_count, s.copy_count) for s in first.shards
    ]
    assert {path.relative_to(tmp_path): path.read_text() for path in tmp_path.glob("job/shards/*/*")} == written
    assert "the shard plan of the job's first run, kept" in again.describe(str(tmp_path / "job"))

    # A tool loop's first plan merges none of its requests: its code's output may change between runs.
    tools = write_job_shards(_items(prompts), str(tmp_path / "tools"), None, 3, settings, tool_loop=True)
    assert not tools.recorded.deduplicate and tools.copies == 0
    assert sum(s.item_count for s in tools.shards) == len(prompts)
