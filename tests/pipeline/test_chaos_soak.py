"""What the chaos soak (bench/chaos_soak.py: the deployment as separate processes, every component
SIGKILLed at random, every job checked completed exactly once) found, each as a test that failed before."""

import logging
import sys
import time
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.events import DagsterEvent, DagsterEventType
from dagster._core.events.log import EventLogEntry
from dagster._core.storage.tags import AUTO_RETRY_RUN_ID_TAG, PARENT_RUN_ID_TAG, ROOT_RUN_ID_TAG
from dagster._daemon.auto_run_reexecution.auto_run_reexecution import filter_runs_to_should_retry

from batch_pipeline.pipeline import sensors
from batch_pipeline.pipeline.retries import MAX_RETRIES, RETRIES_TAG
from batch_pipeline.pipeline.sensors import WILL_RETRY_TAG, record_run_end
from batch_pipeline.store.jobs import JobStore
from batch_pipeline.store.records import NewJob
from batch_pipeline.store.schema import JobStatus
from tests.api_fixtures import seed_home, sensor_resources
from tests.conftest import MODEL
from tests.launch.test_run_workers import _a_job

REPO = Path(__file__).resolve().parents[2]


def _instance_retrying_runs(tmp_path) -> dg.DagsterInstance:
    (tmp_path / "dagster.yaml").write_text(
        "run_retries:\n  enabled: true\n  max_retries: 2\n  retry_on_asset_or_op_failure: false\n"
        "telemetry:\n  enabled: false\n"
    )
    seed_home(tmp_path, job_store=False)
    return dg.DagsterInstance.from_config(str(tmp_path))


def _report_failed(instance: dg.DagsterInstance, run: dg.DagsterRun, seconds_ago: float) -> None:
    """The run's failure as the instance records any (report_run_failed's event), `seconds_ago` back."""
    event = DagsterEvent(
        event_type_value=DagsterEventType.RUN_FAILURE.value,
        job_name=run.job_name,
        message="This run has been marked as failed from outside the execution context.",
    )
    entry = EventLogEntry(
        error_info=None,
        level=logging.ERROR,
        user_message=event.message or "",
        run_id=run.run_id,
        timestamp=time.time() - seconds_ago,
        job_name=run.job_name,
        dagster_event=event,
    )
    instance.handle_new_event(entry)


def _failures(instance: dg.DagsterInstance, run_id: str) -> int:
    return len(instance.all_logs(run_id, of_type=DagsterEventType.RUN_FAILURE))


def test_a_failed_run_the_retry_daemon_never_retried_is_handed_back_to_it_and_its_job_keeps_running(tmp_path):
    """Found by the soak (seed 1): a dequeue that gave up on a down code server failed the run, with
    dagster/will_retry=true, and no retry ever came; the job read running at 0 done until the soak's deadline.
    The instance stores a failure event before it writes the run's status and will_retry tag; the run retry
    daemon read the event in that gap (3 s under load), saw a run not failed, and moved its cursor past it.
    Now the jobs sensor, which reconciles runs ended a minute ago, reports such a run's failure again: the
    daemon reads it anew and retries the run. A run that failed just now is left to the daemon."""
    with _instance_retrying_runs(tmp_path) as instance:
        store = JobStore(f"sqlite:///{tmp_path}/jobs.db")
        runs = {}
        for name, ended_s_ago in (("missed", 120), ("recent", 1)):
            run = instance.create_run_for_job(_a_job, tags={"dagster/max_retries": "2"})
            _report_failed(instance, run, seconds_ago=ended_s_ago)
            job = NewJob(NewJob.new_id(), "team:a", "{}", "0" * 64, MODEL, None, {}, 600, run_id=run.run_id)
            store.create(job)
            store.mark_started(job.job_id, run.run_id)
            runs[name] = (job.job_id, instance.get_run_by_id(run.run_id))
        for _, run in runs.values():
            assert run.tags[WILL_RETRY_TAG] == "true" and AUTO_RETRY_RUN_ID_TAG not in run.tags

        context = dg.build_sensor_context(instance=instance, resources=sensor_resources(str(store.engine.url)))
        list(sensors.batch_jobs_sensor(interval_s=1)(context) or [])

        job_id, missed = runs["missed"]
        assert _failures(instance, missed.run_id) == 2  # a failure newer than the daemon's cursor
        handed_back = instance.get_run_by_id(missed.run_id)
        assert handed_back.tags[RETRIES_TAG] == "1"
        # What the run retry daemon decides when it reads that failure: retry it.
        assert [run.run_id for run in filter_runs_to_should_retry([handed_back], instance)] == [missed.run_id]
        job = store.get(job_id)
        assert job.status == JobStatus.RUNNING and "handed to the run retry daemon again" in job.status_detail

        job_id, recent = runs["recent"]
        assert _failures(instance, recent.run_id) == 1
        assert RETRIES_TAG not in instance.get_run_by_id(recent.run_id).tags
        assert store.get(job_id).status == JobStatus.RUNNING


def _failed_long_ago(instance: dg.DagsterInstance, store: JobStore, tags: dict[str, str] | None = None):
    """A job whose run failed two minutes ago with dagster/will_retry=true, and no retry since."""
    run = instance.create_run_for_job(_a_job, tags={"dagster/max_retries": "2", **(tags or {})})
    _report_failed(instance, run, seconds_ago=120)
    job = NewJob(NewJob.new_id(), "team:a", "{}", "0" * 64, MODEL, None, {}, 600, run_id=run.run_id)
    store.create(job)
    store.mark_started(job.job_id, run.run_id)
    return job.job_id, instance.get_run_by_id(run.run_id)


def _reconcile(instance: dg.DagsterInstance, store: JobStore) -> None:
    context = dg.build_sensor_context(instance=instance, resources=sensor_resources(str(store.engine.url)))
    list(sensors.batch_jobs_sensor(interval_s=1)(context) or [])


def test_a_failed_run_an_operator_re_executed_is_not_handed_back_to_the_retry_daemon(tmp_path):
    """Found by review: Dagster's retry daemon knows its own retries only (dagster/retry_number), so a run an
    operator re-executed from the UI, handed back, would have been retried too: two runs of one job side by
    side, in one work dir."""
    with _instance_retrying_runs(tmp_path) as instance:
        store = JobStore(f"sqlite:///{tmp_path}/jobs.db")
        job_id, failed = _failed_long_ago(instance, store)
        # As the UI's re-execution makes it: its parent and root, as fields and as the tags run groups read.
        lineage = {PARENT_RUN_ID_TAG: failed.run_id, ROOT_RUN_ID_TAG: failed.run_id}
        instance.create_run_for_job(_a_job, parent_run_id=failed.run_id, root_run_id=failed.run_id, tags=lineage)
        _reconcile(instance, store)
        assert _failures(instance, failed.run_id) == 1
        assert RETRIES_TAG not in instance.get_run_by_id(failed.run_id).tags
        assert store.get(job_id).status == JobStatus.RUNNING  # the re-execution carries it


def test_a_failed_run_handed_back_as_often_as_allowed_and_never_retried_fails_its_job_saying_why(tmp_path):
    """Found by review: after its last hand-back such a job read running for ever, holding its team's run
    slot and never resumable."""
    with _instance_retrying_runs(tmp_path) as instance:
        store = JobStore(f"sqlite:///{tmp_path}/jobs.db")
        job_id, failed = _failed_long_ago(instance, store, tags={RETRIES_TAG: str(MAX_RETRIES)})
        _reconcile(instance, store)
        assert _failures(instance, failed.run_id) == 1  # not handed back again
        job = store.get(job_id)
        assert job.status == JobStatus.FAILED
        assert f"never retried the run, handed back {MAX_RETRIES} times" in job.failure_reason


def test_a_failed_run_whose_retry_the_daemon_already_launched_leaves_its_job_running(tmp_path):
    """Found by the soak: a dequeue whose StartRun answered after 60 s (a loaded code server) went back in the
    queue though its run worker had started; the second launch's worker found the run started and exited, so
    the code server failed the run and the daemon launched its retry. The first worker, still running, then
    failed the run again (its shard steps stop once the run has ended), which Dagster does not retry
    (`dagster/will_retry=false`): the job read `failed`, and keep_partial_results wrote an output of error
    entries, while the retry was queued to run the job again."""
    (tmp_path / "dagster.yaml").write_text(
        "run_retries:\n  enabled: true\n  max_retries: 2\n  retry_on_asset_or_op_failure: false\n"
        "telemetry:\n  enabled: false\n"
    )
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        run = instance.create_run_for_job(_a_job, tags={"dagster/max_retries": "2"})
        instance.report_run_failed(run)
        retry = instance.create_run_for_job(_a_job, tags={"dagster/max_retries": "2"})
        # What the run retry daemon leaves on the run it retried, then the second failure's verdict.
        instance.add_run_tags(run.run_id, {AUTO_RETRY_RUN_ID_TAG: retry.run_id, WILL_RETRY_TAG: "false"})
        store = JobStore(f"sqlite:///{tmp_path}/jobs.db")
        job = NewJob(NewJob.new_id(), "team:a", "{}", "0" * 64, MODEL, None, {}, 60, run_id=run.run_id)
        store.create(job)
        keep_partial_results = record_run_end(instance, store, instance.get_run_by_id(run.run_id), job.job_id)
        assert keep_partial_results is None
        assert store.get(job.job_id).status == JobStatus.RUNNING


@pytest.mark.slow
def test_a_short_seeded_soak_completes_every_job_exactly_once_through_every_kind_of_fault(tmp_path):
    """bench/chaos_soak.py at a small size: the embedded deployment as separate processes, two jobs of each kind
    (v1, completion, chat, repeats, data_parallelism 2, sampled with seeds) submitted with client retries and
    an Idempotency-Key, and each fault kind struck at least once (the API, the daemon, the code server, the code
    server just as the queue dequeues, a run worker, a run worker orphaned by a code-server restart, a shard
    worker). Each job must complete exactly once: one row per key, one successful run, n entries in input
    order, its metadata, no stray partial file. `make bench` runs the long one (24 jobs, 24 faults, 3 seeds)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import chaos_soak
    finally:
        sys.path.remove(str(REPO / "bench"))
    config = chaos_soak.SoakConfig(
        seed=5,
        # Each kind twice: faults strike only while jobs are unfinished, and six jobs alone were done before
        # the seventh fault on a fast machine (CI on an AMD EPYC: shard_worker 0 after 101 s).
        jobs=2 * len(chaos_soak.JOB_KINDS),
        faults=len(chaos_soak.FAULT_KINDS),
        gap_s=(2.0, 6.0),
        deadline_s=1200.0,
        work_dir=str(tmp_path / "soak"),
    )
    result = chaos_soak.run_soak(config)
    assert result["passed"], chaos_soak.report(result)
    assert {job["kind"] for job in result["jobs"]} == set(chaos_soak.JOB_KINDS)
    assert {fault["kind"] for fault in result["faults"]} == set(chaos_soak.FAULT_KINDS)


@pytest.mark.slow
def test_a_short_seeded_targeted_soak_completes_every_job_whose_code_server_and_orphaned_run_worker_died(tmp_path):
    """bench/chaos_soak.py's targeted scenario (issue 50) at a small size: the code server killed and started
    again at once, then 1 s after the kill the run worker it left behind, while the new code server still loads.
    Run monitoring fails the run and the run retry daemon's retry meets the loading code server: each job must
    still complete exactly once, its runs one after another. `bench/README.md` has the long one (6 jobs, 4
    faults, 3 seeds)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import chaos_soak
    finally:
        sys.path.remove(str(REPO / "bench"))
    config = chaos_soak.SoakConfig(
        seed=5,
        scenario="targeted",
        # Five jobs for two faults: a fault strikes a job not hit before, while it runs, and on a fast machine
        # three jobs were done before the second could (CI here, AVX-512: 1 of 2 struck, the retry 60 s late
        # as the retry daemon had read its run's failure early).
        jobs=5,
        faults=2,
        in_flight=2,
        gap_s=(2.0, 6.0),
        deadline_s=1200.0,
        work_dir=str(tmp_path / "soak"),
    )
    result = chaos_soak.run_soak(config)
    assert result["passed"], chaos_soak.report(result)
    assert {fault["kind"] for fault in result["faults"]} == set(chaos_soak.TARGETED_FAULT_KINDS)
