"""`keep_partial_results`: the job a run-status sensor launches when a batch run stops before the end
(cancelled, failed, out of time), so that the results its shards finished are not lost: they are merged
into the output in input order, each unfinished request an error entry at its index, with a metadata file
saying how many finished. A job rather than sensor code: retried, visible in the UI, and never under a
sensor's timeout however large the job.

The job's end was recorded with its webhook event held (`store/webhooks.py`): the transaction that records
the output as final releases it, and so does giving up (the last retry failed, or a newer run has the job),
so that a receiver told of the end reads the whole output, and is told even when there is none.
"""

import json

import dagster as dg
from dagster import OpExecutionContext
from pydantic import Field

from batch_pipeline.admission.paths import metadata_path
from batch_pipeline.admission.policy import AdmissionPolicy
from batch_pipeline.contract import ErrorDetail, ErrorOutput
from batch_pipeline.openai_batch.jobs import expired, finalize_batch
from batch_pipeline.pipeline.resources import JobStorage, JobStoreResource
from batch_pipeline.pipeline.tags import STOPPED_RUN_TAG
from batch_pipeline.shards.merge import partial_outputs, progress, write_output_array
from batch_pipeline.shards.metadata import JobMetadata, write_metadata
from batch_pipeline.store.jobs import JobStore
from batch_pipeline.store.progress import ShardProgressStore
from batch_pipeline.store.records import JobRecord
from batch_pipeline.store.results import JobResults
from batch_pipeline.store.webhooks import WebhookOutbox

PARTIAL_RESULTS_TAG = "batch_pipeline/partial_results"  # on the stopped run: "finished/planned"
# Ahead of queued batch runs: it is short, and the user waits for these results.
PARTIAL_RESULTS_PRIORITY = "100"
MERGE_RETRIES = 2


class StoppedRun(dg.Config):
    """The run `merge_finished_results` keeps the finished results of (`partial_results_run_request`)."""

    job_id: str = Field(description="the job whose run stopped")
    run_id: str = Field(description="the run that stopped")
    code: str = Field(description="error code of each unfinished request's entry")
    reason: str = Field(description="message of each unfinished request's entry")
    held_event: str | None = Field(
        default=None, description="the webhook event of the job's end, held until this output is written"
    )


@dg.op(
    retry_policy=dg.RetryPolicy(max_retries=MERGE_RETRIES, delay=5),
    description="Merge the finished results of a stopped run into its output; mark the rest.",
)
def merge_finished_results(
    context: OpExecutionContext,
    config: StoppedRun,
    job_store: JobStoreResource,
    job_storage: JobStorage,
    admission: dg.ResourceParam[AdmissionPolicy],
) -> dict:
    store = job_store.get_store()
    try:
        return _merge(context, config, store, job_storage, admission)
    except Exception as exc:
        if context.retry_number >= MERGE_RETRIES:
            # Given up: the job has stopped, without the output it waited for (a cancelled job reads cancelled
            # once results of its run are recorded), and its end is announced now rather than an hour late.
            why = f"its finished results could not be merged into its output: {type(exc).__name__}: {exc}"
            given_up = JobResults(job_id=config.job_id, dagster_run_id=config.run_id, status=config.code, reason=why)
            ShardProgressStore(engine=store.engine).record_results(
                config.job_id, config.run_id, given_up, held_event=config.held_event
            )
        raise


def _merge(
    context: OpExecutionContext,
    config: StoppedRun,
    store: JobStore,
    job_storage: JobStorage,
    admission: AdmissionPolicy,
) -> dict:
    record = store.get(config.job_id)
    if record is None:
        raise dg.Failure(f"no job {config.job_id} in the job store")
    if record.run_id != config.run_id:
        context.log.info(f"{record.job_id}: a newer run ({record.run_id}) has the job; its output is that run's")
        if config.held_event:  # nothing to wait for: the stopped run's end is announced now
            WebhookOutbox(engine=store.engine).release(config.held_event)
        return {}
    if record.results is not None and record.results.kept_of(config.run_id):
        # A retry after the output was recorded whole (a later call failed): the API may have resumed the
        # job since, and a rewrite would land on the resumed run's output.
        context.log.info(f"{record.job_id}: the finished results of {config.run_id} are already kept")
        if config.held_event:
            WebhookOutbox(engine=store.engine).release(config.held_event)
        return record.results.model_dump(exclude_none=True)
    work_dir = job_storage.work_dir(record.job_id)
    done, total = progress(work_dir)
    output_path = record.request["output_data_path"]
    missing = json.dumps(ErrorOutput(error=ErrorDetail(code=config.code, message=config.reason)).model_dump())
    files = admission.data_files(record.owner, own_dir=work_dir)
    with files.atomic_write(output_path) as output:
        write_output_array(output, partial_outputs(work_dir, lambda _: missing), total)
    results = JobResults(
        job_id=record.job_id,
        dagster_run_id=config.run_id,
        status=config.code,
        num_requests=total,
        num_finished=done,
        num_unfinished=total - done,
        reason=config.reason,
    )
    write_metadata(files, metadata_path(output_path), _stopped_metadata(record, results, done))
    finalize_batch(store, record.job_id, output_path, work_dir, job_storage.files_dir(), expired=expired(record))
    # Last, once every file is written (a batch's output and error files too): the output is final, and the
    # end's event is released in the same transaction.
    ShardProgressStore(engine=store.engine).record_results(
        record.job_id, config.run_id, results, held_event=config.held_event
    )
    context.instance.add_run_tags(config.run_id, {PARTIAL_RESULTS_TAG: f"{done}/{total}"})
    context.log.info(f"{record.job_id}: kept {done} of {total} results in {output_path}")
    context.add_output_metadata({"output_data_path": output_path, "finished": done, "planned": total})
    return results.model_dump(exclude_none=True)


def _stopped_metadata(record: JobRecord, results: JobResults, done: int) -> JobMetadata:
    """A stopped run's metadata file: the summary the job's row keeps, and a resumed job's figures (the
    completion tokens it generated are left out: only a completed run counts its tokens)."""
    metadata = JobMetadata.model_validate(results.model_dump(exclude_none=True))
    return metadata.with_resume(record, done, completion_tokens=None)


@dg.job(
    executor_def=dg.in_process_executor,
    description="The finished results of a stopped batch run, merged into its output (launched by sensors).",
)
def keep_partial_results():
    merge_finished_results()


def keeps_partial_results(record: JobRecord | None) -> bool:
    """Whether a stopped run of this job has finished results to keep: it planned shards."""
    return record is not None and bool(record.requests_total)


def partial_results_run_request(
    record: JobRecord | None, run_id: str, code: str, reason: str, held_event: str | None = None
) -> dg.RunRequest | None:
    """The run that keeps a stopped run's finished results (and releases `held_event`, its end's webhook
    event, once they are written); None when it planned no shards."""
    if record is None or not keeps_partial_results(record):
        return None
    config = StoppedRun(job_id=record.job_id, run_id=run_id, code=code, reason=reason, held_event=held_event)
    return dg.RunRequest(
        run_key=f"partial-results:{run_id}",
        run_config={"ops": {"merge_finished_results": {"config": config.model_dump()}}},
        tags={"dagster/priority": PARTIAL_RESULTS_PRIORITY, STOPPED_RUN_TAG: run_id},
    )
