"""Sensors: jobs in the store become runs; runs stopped early keep the results they finished."""

import json
import os

import dagster as dg
from dagster import RunStatusSensorContext, SensorEvaluationContext
from pydantic import ValidationError

from batch_pipeline import io
from batch_pipeline.contract import CreateBatchCompletionsV2Request, ErrorDetail, ErrorOutput
from batch_pipeline.contract.base import wire_value_problem
from batch_pipeline.contract.records import describe_validation_error
from batch_pipeline.jobs_store import JobRecord
from batch_pipeline.pipeline.execute import run_config_for
from batch_pipeline.pipeline.job import batch_completions, job_id_of, metadata_path
from batch_pipeline.pipeline.resources import JobStorage, JobStoreResource
from batch_pipeline.pipeline.tags import JOB_ID_TAG, SCHEDULE_OWNER_PREFIX, run_tags
from batch_pipeline.shards import partial_outputs, progress, write_output_array

PARTIAL_RESULTS_TAG = "batch_pipeline/partial_results"
ROOT_RUN_ID_TAG = "dagster/root_run_id"  # Dagster's tag on every re-execution
WILL_RETRY_TAG = "dagster/will_retry"  # set on a failed run the daemon will retry
SENSOR_INTERVAL_S = int(os.environ.get("BATCH_PIPELINE_SENSOR_INTERVAL_S", "2"))


def find_run(instance: dg.DagsterInstance, job_id: str) -> dg.DagsterRun | None:
    """The job's newest run: its own, or a re-execution of it (which need not carry the job's tags)."""
    runs = instance.get_runs(filters=dg.RunsFilter(tags={JOB_ID_TAG: job_id}), limit=1)
    if not runs:
        return None
    # Every re-execution is newer than the run it re-executes, and carries the first run's id as its root
    # (a tagged run that is itself a re-execution is among them): the newest of them is the job's newest run.
    first_run_id = runs[0].root_run_id or runs[0].run_id
    reexecutions = instance.get_runs(filters=dg.RunsFilter(tags={ROOT_RUN_ID_TAG: first_run_id}), limit=1)
    return reexecutions[0] if reexecutions else runs[0]


# One tick's run requests travel to the daemon as one gRPC message, capped by Dagster at 100 MB: a tick
# stops taking jobs once their requests reach this many bytes (it takes one at least); the rest follow.
DEFAULT_MAX_TICK_BYTES = 32 * 1024 * 1024


def _max_tick_bytes() -> int:
    return int(os.environ.get("BATCH_PIPELINE_SENSOR_MAX_TICK_BYTES", DEFAULT_MAX_TICK_BYTES))


@dg.sensor(
    job=batch_completions,
    minimum_interval_seconds=SENSOR_INTERVAL_S,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Turns each job the API stored into exactly one run (run_key = job id). A job that cannot "
    "become a run is marked failed with the reason; the others go on.",
)
def batch_jobs_sensor(context: SensorEvaluationContext, job_store: JobStoreResource):
    store = job_store.get_store()
    budget, taken = _max_tick_bytes(), 0
    for job_id in store.awaiting_launch():
        record = store.get(job_id)
        if record is None or record.run_id is not None or record.cancelled_at is not None:
            continue  # changed since the list was read
        run = find_run(context.instance, record.job_id)
        if run is not None:
            store.link_run(record.job_id, run.run_id)
            continue
        if record.owner.startswith(SCHEDULE_OWNER_PREFIX):
            continue  # its tick launches it; launching here too could race that into a second run
        size = len(record.request_json)
        if taken and taken + size > budget:
            break
        try:
            run_request = _run_request(record)
        except Exception as exc:  # _run_request reads only the record: whatever fails, fails for this job alone
            reason = f"could not start: {_shortened(exc)}"
            context.log.warning(f"{record.job_id}: {reason}")
            store.mark_failed(record.job_id, reason)
            continue
        taken += size
        yield run_request


def _run_request(record: JobRecord) -> dg.RunRequest:
    """The job's run request, checked as the daemon will check it when it creates the run (the request by
    the contract, the run config by the job's config schema, the tags as storable text), so that what is
    yielded cannot fail the tick for every job."""
    try:
        # From Python's parse of the row, not pydantic's JSON: it reads what an older release stored (a lone
        # surrogate escape) and the contract then names the field.
        request = CreateBatchCompletionsV2Request.model_validate(record.request)
    except ValidationError as exc:
        raise ValueError(f"invalid request: {describe_validation_error(exc)}") from None
    tags = run_tags(record)
    if problem := wire_value_problem(tags):
        raise ValueError(f"run tags (labels, model): {problem}")
    run_config = run_config_for(request)
    dg.validate_run_config(batch_completions, run_config)  # DagsterInvalidConfigError names the field
    return dg.RunRequest(run_key=record.job_id, run_config=run_config, tags=tags)


def _shortened(exc: Exception) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text if len(text) <= 2000 else text[:2000] + "..."


def _keep_partial_results(context: RunStatusSensorContext, job_storage: JobStorage, code: str, why: str) -> None:
    run = context.dagster_run
    if run.tags.get(PARTIAL_RESULTS_TAG):
        return
    job_id = job_id_of(context.instance, run)
    work_dir = job_storage.work_dir(job_id)
    done, total = progress(work_dir)
    if total == 0:
        return
    output_path = run.run_config["ops"]["validate_input"]["config"]["output_data_path"]
    missing = json.dumps(ErrorOutput(error=ErrorDetail(code=code, message=why)).model_dump())
    write_output_array(output_path, partial_outputs(work_dir, lambda _: missing), total)
    with io.atomic_write(metadata_path(output_path), "w") as handle:
        json.dump({"job_id": job_id, "dagster_run_id": run.run_id, "status": code, "num_requests": total,
                   "num_finished": done, "num_unfinished": total - done, "reason": why}, handle, indent=2)
    context.instance.add_run_tags(run.run_id, {PARTIAL_RESULTS_TAG: f"{done}/{total}"})
    context.log.info(f"{job_id}: kept {done} of {total} results in {output_path}")


@dg.run_status_sensor(
    run_status=dg.DagsterRunStatus.CANCELED,
    monitored_jobs=[batch_completions],
    default_status=dg.DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=SENSOR_INTERVAL_S,
    description="A cancelled run's finished results are merged into its output; the rest are marked.",
)
def keep_results_of_cancelled_runs(context: RunStatusSensorContext, job_storage: JobStorage):
    _keep_partial_results(context, job_storage, "cancelled", "the job was cancelled before this request finished")


@dg.run_failure_sensor(
    monitored_jobs=[batch_completions],
    default_status=dg.DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=SENSOR_INTERVAL_S,
    description="A failed run's finished results are merged into its output; the rest are marked.",
)
def keep_results_of_failed_runs(context: dg.RunFailureSensorContext, job_storage: JobStorage):
    run = context.instance.get_run_by_id(context.dagster_run.run_id) or context.dagster_run
    if run.tags.get(WILL_RETRY_TAG) == "true":
        return  # the daemon retries it: the retry writes the whole output, or keeps these results if it fails too
    reason = context.failure_event.message or "the job failed"
    try:
        _keep_partial_results(context, job_storage, "job_failed", f"the job failed before this request finished: {reason}")
    except OSError as exc:  # e.g. the output location itself is what failed the job
        context.log.warning(f"could not keep partial results: {exc}")
