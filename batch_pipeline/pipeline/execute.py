"""Running a request as a Dagster run on an instance, without the API: the CLI's `run`, and tests."""

from __future__ import annotations

import dagster as dg

from batch_pipeline.contract import CreateBatchCompletionsV2Request
from batch_pipeline.core.settings import settings
from batch_pipeline.pipeline.config_schema import run_config_for
from batch_pipeline.pipeline.runs import launch_tags
from batch_pipeline.pipeline.tags import JOB_ID_TAG
from batch_pipeline.store.jobs import JobStore


def execute_request(
    request: CreateBatchCompletionsV2Request,
    instance: dg.DagsterInstance,
    job_id: str | None = None,
    log_level: str | None = None,
    team: str | None = None,
) -> dg.JobExecutionResult:
    """Run `request` to its end on `instance`: as the run of the stored job `job_id` (launched for it, as the
    jobs sensor would), else as a new job of `team` (required where the deployment has a tenants file)."""
    from batch_pipeline.pipeline.definitions import batch_completions_job
    from batch_pipeline.pipeline.job import TEAM_FIELD
    from batch_pipeline.pipeline.sensors import record_run_end

    # The run's step processes load the definitions afresh, with the settings of now, as this store is: not
    # the definitions this process may have loaded under another DAGSTER_HOME (a CLI's, a test's).
    store = JobStore(settings().job_store_url)
    tags = None
    if job_id is not None:
        record = store.get(job_id)
        tags = launch_tags(instance, record) if record is not None else {JOB_ID_TAG: job_id}
    run_config = run_config_for(request, log_level)
    if team is not None:
        run_config["ops"]["validate_input"]["config"][TEAM_FIELD] = team
    result = dg.execute_job(
        dg.reconstructable(batch_completions_job),
        instance=instance,
        run_config=run_config,
        tags=tags,
        raise_on_error=False,
    )
    # No daemon runs the status sensors here: how the run ended goes into its job's row now.
    run = instance.get_run_by_id(result.run_id)
    assert run is not None  # execute_job has just stored this run in the instance
    record_run_end(instance, store, run)
    return result
