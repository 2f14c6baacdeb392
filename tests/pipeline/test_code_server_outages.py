"""A code server that is briefly down fails no job: the queue waits it out, a run that still fails that way
is retried once the location answers, and a job that fails says the code location was the cause."""

import json
import os
import signal
import sys
import time

import dagster as dg
import httpx
import pytest
from dagster._core.errors import DagsterUserCodeUnreachableError
from dagster._core.events import EngineEventData
from dagster._utils.error import serializable_error_info_from_exc_info

from batch_pipeline.pipeline.retries import MAX_RETRIES, RETRIES_TAG
from batch_pipeline.pipeline.sensors import WILL_RETRY_TAG, failure_reason, record_run_end
from batch_pipeline.pipeline.tags import DEADLINE_TAG, JOB_ID_TAG, RESUME_TAG
from batch_pipeline.store.jobs import JobStore
from batch_pipeline.store.records import NewJob
from batch_pipeline.store.schema import JobStatus
from tests.conftest import MODEL
from tests.entrypoints.test_serve import _descendants
from tests.launch.test_run_workers import _a_job, deployment_with_its_own_code_server


@pytest.fixture
def instance(tmp_path):
    (tmp_path / "dagster.yaml").write_text(
        "run_retries:\n  enabled: true\n  max_retries: 2\n  retry_on_asset_or_op_failure: false\n"
        "telemetry:\n  enabled: false\n"
    )
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        yield instance


def _unreachable() -> EngineEventData:
    try:
        raise DagsterUserCodeUnreachableError("Could not reach user code server. gRPC Error code: UNAVAILABLE")
    except DagsterUserCodeUnreachableError:
        return EngineEventData.engine_error(serializable_error_info_from_exc_info(sys.exc_info()))


def _job_of_a_failed_run(instance, tmp_path, error: EngineEventData, message: str, run=None, tags=None):
    """A job whose run (`run`, else a new one with `tags`) the daemon gave up on, as Dagster records it: an
    engine event with the error, the run's failure, and `dagster/will_retry=false` (what the run retry daemon
    sets when it cannot retry)."""
    run = run or instance.create_run_for_job(_a_job, tags={"dagster/max_retries": "2", **(tags or {})})
    instance.report_engine_event(message, run, error)
    instance.report_run_failed(run)
    instance.add_run_tags(run.run_id, {WILL_RETRY_TAG: "false"})
    store = JobStore(f"sqlite:///{tmp_path}/jobs.db")
    job = NewJob(NewJob.new_id(), "team:a", "{}", "0" * 64, MODEL, None, {}, 60, run_id=run.run_id)
    store.create(job)
    return store, job.job_id, instance.get_run_by_id(run.run_id)


def test_a_run_the_retry_daemon_gave_up_on_for_an_unreachable_code_server_is_retried_once_it_answers(
    instance, tmp_path
):
    """On main the job read failed for good: "This run has been marked as failed from outside"."""
    store, job_id, run = _job_of_a_failed_run(instance, tmp_path, _unreachable(), "Failed to retry run")
    failures_before = len(instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE))
    record_run_end(instance, store, run, job_id)
    job = store.get(job_id)
    assert job.status == JobStatus.RUNNING and "code location could not be reached" in job.status_detail
    run = instance.get_run_by_id(run.run_id)
    assert run.tags[RETRIES_TAG] == "1"
    # A new failure event for the run retry daemon, which the instance marks as one it will retry.
    assert len(instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE)) == failures_before + 1
    assert run.tags[WILL_RETRY_TAG] == "true"


def _handed_back(instance, run) -> bool:
    return RETRIES_TAG in instance.get_run_by_id(run.run_id).tags


def test_an_error_a_step_reports_after_the_retry_met_the_outage_does_not_hide_the_outage(instance, tmp_path):
    """Found by the soak (issue 50): the shard step outlived its killed run worker and reported its stopped
    shard (an error of its own) after the run retry daemon's retry had met the code server still loading. The
    newest error was the step's: the run was not handed back, and its job failed for good."""
    store, job_id, run = _job_of_a_failed_run(instance, tmp_path, _unreachable(), "Failed to retry run")
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        stopped = EngineEventData.engine_error(serializable_error_info_from_exc_info(sys.exc_info()))
    instance.report_engine_event(
        "[pipes] external process pipes closed with exception", run, stopped, step_key="run_shard[shard_000]"
    )
    record_run_end(instance, store, run, job_id)
    job = store.get(job_id)
    assert job.status == JobStatus.RUNNING and "code location could not be reached" in job.status_detail
    assert _handed_back(instance, run)
    assert instance.get_run_by_id(run.run_id).tags[WILL_RETRY_TAG] == "true"


def test_a_run_whose_retries_are_spent_is_not_handed_back_after_an_outage_and_its_job_says_why(instance, tmp_path):
    """Handed back, a run the daemon would not retry (its run group holds `dagster/max_retries` retries
    already) only failed again, five times over, while its job read running."""
    from dagster._core.storage.tags import PARENT_RUN_ID_TAG, ROOT_RUN_ID_TAG

    root = instance.create_run_for_job(_a_job, tags={"dagster/max_retries": "2"})
    parent = root
    for _ in range(2):  # the daemon's two retries, each of the run before it
        lineage = {PARENT_RUN_ID_TAG: parent.run_id, ROOT_RUN_ID_TAG: root.run_id, "dagster/max_retries": "2"}
        parent = instance.create_run_for_job(_a_job, parent_run_id=parent.run_id, root_run_id=root.run_id, tags=lineage)
    store, job_id, last = _job_of_a_failed_run(instance, tmp_path, _unreachable(), "Failed to retry run", run=parent)
    record_run_end(instance, store, last, job_id)
    assert not _handed_back(instance, last)
    job = store.get(job_id)
    assert job.status == JobStatus.FAILED and "code location could not be reached" in job.failure_reason


def test_a_run_past_its_jobs_deadline_is_not_handed_back_after_an_outage(instance, tmp_path):
    store, job_id, run = _job_of_a_failed_run(
        instance, tmp_path, _unreachable(), "Failed to retry run", tags={DEADLINE_TAG: repr(time.time() - 1)}
    )
    record_run_end(instance, store, run, job_id)
    assert not _handed_back(instance, run)
    assert store.get(job_id).status == JobStatus.FAILED


def test_a_run_is_not_handed_back_beside_another_unfinished_run_of_its_job(instance, tmp_path):
    """A resume makes a new run of the job: the old run handed back as well would run the job twice."""
    tags = {JOB_ID_TAG: "batch-0123"}
    store, job_id, run = _job_of_a_failed_run(instance, tmp_path, _unreachable(), "Failed to retry run", tags=tags)
    instance.create_run_for_job(_a_job, tags={**tags, RESUME_TAG: "1"})  # not started yet: unfinished
    failures_before = len(instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE))
    record_run_end(instance, store, run, job_id)
    assert not _handed_back(instance, run)
    assert len(instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE)) == failures_before


def test_after_its_retries_a_job_failed_by_an_unreachable_code_server_says_so(instance, tmp_path):
    store, job_id, run = _job_of_a_failed_run(instance, tmp_path, _unreachable(), "Failed to retry run")
    instance.add_run_tags(run.run_id, {RETRIES_TAG: str(MAX_RETRIES)})
    record_run_end(instance, store, instance.get_run_by_id(run.run_id), job_id)
    job = store.get(job_id)
    assert job.status == JobStatus.FAILED
    assert job.failure_reason.startswith("the code location could not be reached: Failed to retry run")
    assert "UNAVAILABLE" in job.failure_reason and "from outside" not in job.failure_reason


def test_a_run_failed_from_outside_for_another_reason_is_not_retried(instance, tmp_path):
    try:
        raise RuntimeError("the launcher refused the run")
    except RuntimeError:
        other = EngineEventData.engine_error(serializable_error_info_from_exc_info(sys.exc_info()))
    store, job_id, run = _job_of_a_failed_run(instance, tmp_path, other, "Caught an unrecoverable error")
    record_run_end(instance, store, run, job_id)
    assert store.get(job_id).status == JobStatus.FAILED
    assert RETRIES_TAG not in instance.get_run_by_id(run.run_id).tags
    assert (
        failure_reason(instance, run.run_id) == "This run has been marked as failed from outside the execution context."
    )


@pytest.mark.slow
def test_a_run_dequeued_while_its_code_server_is_down_waits_for_it_and_its_job_completes(tmp_path):
    """On main the queue failed the run at once ("Caught an unrecoverable error while dequeuing the run"),
    and its job stayed failed, with no output."""
    # The queue's retry delay shortened from the shipped 10 s; how many retries, as shipped.
    served, home, servers, restart = deployment_with_its_own_code_server(tmp_path, user_code_failure_retry_delay=3)
    try:
        served.wait_until_up()

        def submit(name: str, prompts: int) -> str:
            request = {
                "output_data_path": str(tmp_path / f"{name}.json"),
                "model_config": {"model": MODEL},
                "content": {
                    "prompts": [f"Count to {i}." for i in range(prompts)],
                    "max_new_tokens": 8,
                    "temperature": 0.0,
                },
            }
            created = httpx.post(f"{served.api}/v2/batch-completions", json=request, timeout=30)
            assert created.status_code == 200, created.text
            return created.json()["job_id"]

        first, second = submit("first", 6), submit("second", 2)
        instance = dg.DagsterInstance.from_config(str(home))
        deadline = time.monotonic() + 300

        def run_of(job_id: str) -> dg.DagsterRun | None:
            runs = instance.get_runs(filters=dg.RunsFilter(tags={"batch_pipeline/job_id": job_id}))
            return runs[-1] if runs else None

        # The second job's run waits in Dagster's queue behind the first's (one run slot).
        while not ((run := run_of(first)) and run.status == dg.DagsterRunStatus.STARTED and run_of(second)):
            assert time.monotonic() < deadline, served.log.read_text()[-3000:]
            time.sleep(0.2)
        assert run_of(second).status == dg.DagsterRunStatus.QUEUED
        servers[0].kill()  # down while the first run ends and the queue dequeues the second
        servers[0].wait()
        while run_of(first).status != dg.DagsterRunStatus.SUCCESS:
            assert time.monotonic() < deadline, "the first run did not end"
            time.sleep(0.5)
        waiting = run_of(second)
        while not any(
            "failed to reach the user code server" in (record.message or "")
            for record in instance.all_logs(waiting.run_id)
        ):
            assert time.monotonic() < deadline, [record.message for record in instance.all_logs(waiting.run_id)]
            time.sleep(0.5)
        # Back in the queue, not failed. Dagster logs that message, then enqueues the run again (a moment
        # later it reads STARTING), and tries it again each retry delay while the server is down.
        while (status := run_of(second).status) != dg.DagsterRunStatus.QUEUED:
            assert status in (dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.QUEUED), status
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        restart()
        for job_id in (first, second):
            while (job := httpx.get(f"{served.api}/v2/batch-completions/{job_id}", timeout=10).json()["job"])[
                "status"
            ] not in ("completed", "failed"):
                assert time.monotonic() < deadline, job
                time.sleep(1)
            assert job["status"] == "completed", job
        assert len(json.loads((tmp_path / "second.json").read_text())) == 2
    finally:
        served.kill()
        for server in servers:
            server.kill()


def test_a_run_an_operator_re_executed_is_not_handed_back_after_an_outage(instance, tmp_path):
    """Found by review: like a missed retry, a run the daemon gave up on in an outage, already re-executed
    from the UI, was handed back too: the daemon's retry and the operator's run would run the job together."""
    from dagster._core.storage.tags import PARENT_RUN_ID_TAG, ROOT_RUN_ID_TAG

    store, job_id, run = _job_of_a_failed_run(instance, tmp_path, _unreachable(), "Failed to retry run")
    lineage = {PARENT_RUN_ID_TAG: run.run_id, ROOT_RUN_ID_TAG: run.run_id}
    instance.create_run_for_job(_a_job, parent_run_id=run.run_id, root_run_id=run.run_id, tags=lineage)
    failures_before = len(instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE))
    record_run_end(instance, store, run, job_id)
    assert len(instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE)) == failures_before
    assert RETRIES_TAG not in instance.get_run_by_id(run.run_id).tags


def _step_pid(instance: dg.DagsterInstance, run_id: str, step_prefix: str) -> int:
    """The process of the run's step whose key starts so, as its STEP_START event names it."""
    for record in instance.all_logs(run_id, of_type=dg.DagsterEventType.STEP_START):
        if (record.step_key or "").startswith(step_prefix) and record.dagster_event is not None:
            return record.dagster_event.pid
    raise AssertionError(f"no {step_prefix} step started in run {run_id}")


@pytest.mark.slow
def test_a_run_failed_while_its_code_server_is_down_is_retried_once_it_answers_and_its_job_completes_once(tmp_path):
    """Found by the soak (issue 50): the code server killed, its orphaned run worker killed a second later; run
    monitoring failed the run, and the run retry daemon's retry met the code server still loading (gRPC
    UNAVAILABLE), which Dagster marks `dagster/will_retry=false` and never looks at again. The run's shard step,
    which outlived its run worker, then stopped its shard and reported that with an error of its own; the
    hand-back took the newest error for the cause, saw no outage, and the job ended failed, every entry
    job_failed. Here the code server stays down until the retry has failed, and the shard step (held
    stopped, as a loaded machine holds it) reports after it."""
    served, home, servers, restart = deployment_with_its_own_code_server(tmp_path, poll_interval_seconds=2)
    try:
        served.wait_until_up()
        prompts = [f"Write a long story about the number {i}." for i in range(12)]
        output = tmp_path / "output.json"
        request = {
            "output_data_path": str(output),
            "model_config": {"model": MODEL},
            "content": {"prompts": prompts, "max_new_tokens": 48, "temperature": 0.0},
        }
        created = httpx.post(f"{served.api}/v2/batch-completions", json=request, timeout=30)
        assert created.status_code == 200, created.text
        job_id = created.json()["job_id"]
        results = home / "work" / job_id / "shards" / "000" / "results.tsv"
        deadline = time.monotonic() + 600  # a cold engine start takes minutes on a loaded machine
        while not (results.exists() and results.read_text().count("\n") >= 2):
            assert time.monotonic() < deadline, f"no results; serve log:\n{served.log.read_text()[-3000:]}"
            time.sleep(0.1)
        instance = dg.DagsterInstance.from_config(str(home))
        (run,) = instance.get_runs()
        worker_pid = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_START)[-1].dagster_event.pid
        step_pid = _step_pid(instance, run.run_id, "run_shard")
        held = [worker_pid, step_pid, *_descendants(step_pid)]  # the run worker, the shard step, its shard worker
        for pid in held:
            os.kill(pid, signal.SIGSTOP)
        servers[0].kill()  # the run worker lives on, orphaned
        servers[0].wait()
        time.sleep(1)
        os.kill(worker_pid, signal.SIGKILL)

        def errors() -> list[tuple[str | None, str]]:
            """Each engine event of the run that carries an error: its step (None: the run's), its message."""
            return [
                (record.step_key, record.message)
                for record in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ENGINE_EVENT)
                if record.dagster_event is not None and record.dagster_event.engine_event_data.error is not None
            ]

        while (None, "Failed to retry run") not in errors():
            assert time.monotonic() < deadline, [record.message for record in instance.all_logs(run.run_id)]
            time.sleep(0.5)
        assert instance.get_run_by_id(run.run_id).tags[WILL_RETRY_TAG] == "false"
        for pid in held[1:]:
            os.kill(pid, signal.SIGCONT)
        # The shard step finds its run ended, stops its worker, and reports an error after the daemon's.
        while errors()[-1][0] is None:
            assert time.monotonic() < deadline, errors()
            time.sleep(0.5)
        restart()
        while (job := httpx.get(f"{served.api}/v2/batch-completions/{job_id}", timeout=10).json()["job"])[
            "status"
        ] not in ("completed", "failed"):
            assert time.monotonic() < deadline + 600, job
            time.sleep(1)
        assert job["status"] == "completed", job
        runs = instance.get_runs(filters=dg.RunsFilter(tags={"batch_pipeline/job_id": job_id}))
        assert [other.status for other in runs].count(dg.DagsterRunStatus.SUCCESS) == 1
        assert all(other.is_finished for other in runs)
        entries = json.loads(output.read_text())
        assert len(entries) == len(prompts)
        assert all("text" in entry and entry["num_completion_tokens"] >= 1 for entry in entries), entries
    finally:
        served.kill()
        for server in servers:
            server.kill()
