"""What the chaos soak (bench/chaos_soak.py: the deployment as separate processes, every component
SIGKILLed at random, every job checked completed exactly once) found, each as a test that failed before."""

import dagster as dg
from dagster._core.storage.tags import AUTO_RETRY_RUN_ID_TAG

from batch_pipeline.pipeline.sensors import WILL_RETRY_TAG, record_run_end
from batch_pipeline.store.jobs import JobStore, NewJob
from batch_pipeline.store.schema import JobStatus
from tests.conftest import MODEL
from tests.test_run_workers import _a_job


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
