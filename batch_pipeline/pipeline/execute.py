"""Running a request as a Dagster run on an instance, without the API: the CLI's `run`, and tests."""

from __future__ import annotations

import dagster as dg

from batch_pipeline.contract import CreateBatchCompletionsV2Request
from batch_pipeline.pipeline.config_schema import run_config_for
from batch_pipeline.pipeline.tags import JOB_ID_TAG


def execute_request(
    request: CreateBatchCompletionsV2Request,
    instance: dg.DagsterInstance,
    job_id: str | None = None,
    log_level: str | None = None,
) -> dg.JobExecutionResult:
    from batch_pipeline.pipeline.definitions import batch_completions_job, job_store
    from batch_pipeline.pipeline.sensors import record_run_end

    tags = {JOB_ID_TAG: job_id} if job_id else None
    result = dg.execute_job(
        dg.reconstructable(batch_completions_job),
        instance=instance,
        run_config=run_config_for(request, log_level),
        tags=tags,
        raise_on_error=False,
    )
    # No daemon runs the status sensors here: how the run ended goes into its job's row now.
    run = instance.get_run_by_id(result.run_id)
    assert run is not None  # execute_job has just stored this run in the instance
    record_run_end(instance, job_store.get_store(), run)
    return result
