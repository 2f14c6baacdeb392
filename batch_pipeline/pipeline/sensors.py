"""Sensors launch and record; jobs do the work.

The deployment chooses how often they tick (definitions.py passes BATCH_PIPELINE_SENSOR_INTERVAL_S), so each
is built by a function of that interval:

- `batch_jobs_sensor`: each job the submission path stored becomes exactly one run (run_key = job id).
- `run_end_sensors` (`record_succeeded_runs`, `record_stopped_runs`, `record_failed_runs`): how a run
  ended goes into its job's row, and a run stopped before the end launches `keep_partial_results` (a small
  job, retried and visible in the UI) to merge the results its shards finished. No sensor reads results.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import UTC, datetime

import dagster as dg
from dagster import DagsterEventType, RunStatusSensorContext, SensorEvaluationContext
from dagster._core.storage.tags import AUTO_RETRY_RUN_ID_TAG, WILL_RETRY_TAG
from pydantic import ValidationError

from batch_pipeline.admission.submission import StoredRequest
from batch_pipeline.contract.base import wire_value_problem
from batch_pipeline.contract.records import describe_validation_error
from batch_pipeline.pipeline.config_schema import run_config_for
from batch_pipeline.pipeline.job import batch_completions
from batch_pipeline.pipeline.partial_results import (
    keep_partial_results,
    keeps_partial_results,
    partial_results_run_request,
)
from batch_pipeline.pipeline.resources import JobStoreResource, RunLaunching, Tenancy
from batch_pipeline.pipeline.retries import (
    MAX_RETRIES,
    describe_outage,
    is_retry_of_completed,
    outage_error,
    retry_after_outage,
    retry_missed_read,
)
from batch_pipeline.pipeline.run_slots import free_run_slots, slot_grants, waiting_queues
from batch_pipeline.pipeline.runs import job_id_of, launch_key, launch_signature, not_the_run_of
from batch_pipeline.pipeline.tags import JOB_ID_TAG, LAUNCH_TAG, SCHEDULE_OWNER_PREFIX, run_key, run_tags
from batch_pipeline.store.jobs import JobStore
from batch_pipeline.store.records import JobRecord
from batch_pipeline.store.schema import JobStatus
from batch_pipeline.store.sharing import SharingStore
from batch_pipeline.tenancy.tenants import Tenants

# A row still unfinished this long after its run ended missed the status sensors (they were stopped, or
# the row was written by a release before them): the jobs sensor sets it from the run. A run retry the
# daemon meant to launch exists by then too (it ticks every 5 s).
RECONCILE_AFTER_S = 60
_FINISHED_RUNS = (dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED)


def batch_jobs_sensor(interval_s: int) -> dg.SensorDefinition:
    """The sensor that turns stored jobs into runs, evaluated at most every `interval_s` seconds."""

    @dg.sensor(
        job=batch_completions,
        minimum_interval_seconds=interval_s,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Turns each job the API stored into exactly one run (run_key = job id). A job that cannot "
        "become a run is marked failed with the reason; the others go on.",
    )
    def batch_jobs_sensor(  # the sensor's name
        context: SensorEvaluationContext, job_store: JobStoreResource, tenancy: Tenancy, run_launching: RunLaunching
    ):
        store = job_store.get_store()
        yield from _run_requests(context, store, tenancy, run_launching.max_tick_bytes)
        try:
            _reconcile(context.instance, store)
        except Exception as exc:  # a safety net for stale rows: it never costs the jobs above their runs
            context.log.warning(f"could not reconcile finished runs with their jobs: {_shortened(exc)}")

    return batch_jobs_sensor


def _run_requests(context: SensorEvaluationContext, store: JobStore, tenancy: Tenancy, tick_bytes: int):
    registry = tenancy.registry()
    key = launch_key(context.instance)
    assert key is not None  # made if missing
    if registry is None:
        yield from _launchable(context, store, _waiting(context, store, key), tick_bytes, None, key)
        return
    # Teams share the run slots: only the jobs fair share picks for the free slots get runs now. The waiting
    # jobs are read light (id, owner, priority, age), and only the chosen ones whole.
    now = datetime.now(UTC)
    sharing = SharingStore(engine=store.engine)
    _link_unfinished_runs(context.instance, store, sharing, key)
    _fail_expired(store, sharing, now)
    queues = waiting_queues(sharing, registry, skip_owners=SCHEDULE_OWNER_PREFIX)
    if not len(queues):
        return
    slots = free_run_slots(context.instance)
    chosen = slot_grants(queues, sharing, registry, slots, now, tenancy.fair_share_half_life_s)
    records = sharing.waiting_records(admission.job.job_id for admission in chosen)
    runs = _tagged_runs(context.instance, records, key)
    for job_id, run_id in runs.items():  # a run the daemon made, already finished: the status sensors record it
        store.link_run(job_id, run_id)
    given = {record.job_id for record in records} - set(runs)
    for admission in chosen:  # one line a job: whose, which, and why it won the slot
        job = admission.job
        if job.job_id in given:
            context.log.info(f"fair share: {job.owner}'s job {job.job_id} takes a run slot ({admission.why})")
    for owner, why in chosen.held.items():  # one line a held team, not one a job
        context.log.info(f"fair share: {owner}'s {why}")
    if len(chosen) < len(queues):
        context.log.info(f"{len(queues) - len(chosen)} jobs wait for a run slot ({slots} free)")
    given_records = (record for record in records if record.job_id in given)
    yield from _launchable(context, store, given_records, tick_bytes, registry, key)


_UNFINISHED = [status for status in dg.DagsterRunStatus if status not in _FINISHED_RUNS]


def _link_unfinished_runs(instance: dg.DagsterInstance, store: JobStore, sharing: SharingStore, key: bytes) -> None:
    """The runs the daemon made since the last tick, linked to their jobs, which hold run slots from now
    on (a team's `max_running_jobs` counts them): one query of the unfinished runs, not one per job waiting.
    Only a run launched for its job: another run tagged with the job's id is not the job's."""
    runs = instance.get_runs(filters=dg.RunsFilter(job_name=batch_completions.name, statuses=_UNFINISHED))
    run_of_job = {run.tags[JOB_ID_TAG]: run for run in reversed(runs) if JOB_ID_TAG in run.tags}
    for record in sharing.waiting_records(run_of_job):
        run = run_of_job[record.job_id]
        if run.tags.get(LAUNCH_TAG) == launch_signature(key, record.job_id, record.resume_count):
            store.link_run(record.job_id, run.run_id)


def _fail_expired(store: JobStore, sharing: SharingStore, now: datetime) -> None:
    """A job whose deadline passed while it waited fails with the reason, as its run would have."""
    for job_id, owner, expires_at in sharing.expired_waiting(now):
        if owner.startswith(SCHEDULE_OWNER_PREFIX):
            continue  # its tick launches it
        store.mark_failed(
            job_id,
            f"max_runtime_sec exceeded: the job's deadline ({expires_at.isoformat()}) passed while it waited for "
            "a run slot",
        )


def _waiting(context: SensorEvaluationContext, store: JobStore, key: bytes) -> Iterator[JobRecord]:
    """The queued jobs still without a run, oldest first; the runs the daemon made since the last tick are
    linked to their jobs on the way."""
    for records in store.awaiting_launch():
        runs = _tagged_runs(context.instance, records, key)
        for record in records:
            if record.job_id in runs:  # the daemon made its run since the last tick
                store.link_run(record.job_id, runs[record.job_id])
                continue
            if record.owner.startswith(SCHEDULE_OWNER_PREFIX):
                continue  # its tick launches it; launching here too could race that into a second run
            yield record


def _launchable(
    context: SensorEvaluationContext,
    store: JobStore,
    records: Iterable[JobRecord],
    budget: int,
    registry: Tenants | None,
    key: bytes,
):
    """Each job's run request, as many as `budget` bytes of requests (one at least), at most at its team's
    priority cap (`registry`: the teams), signed with the launch `key`; a job whose request cannot be made
    fails alone."""
    taken = 0
    for record in records:
        size = len(record.request_json)
        if taken and taken + size > budget:
            return
        try:
            run_request = run_request_for(record, registry.priority_cap(record.owner) if registry else None, key)
        except Exception as exc:  # run_request_for reads only the record: whatever fails, fails for this job alone
            reason = f"could not start: {_shortened(exc)}"
            context.log.warning(f"{record.job_id}: {reason}")
            store.mark_failed(record.job_id, reason)
            continue
        taken += size
        yield run_request


def _tagged_runs(instance: dg.DagsterInstance, records: list[JobRecord], key: bytes) -> dict[str, str]:
    """The id of a run of each of these jobs that has one, in one query; of a resumed job, a run of its
    latest resume only (its runs from before the resume are finished, and not this resume's run). Only runs
    launched for their job (signed with the launch `key`): a run merely tagged with a job's id is none."""
    if not records:
        return {}
    signed = {record.job_id: launch_signature(key, record.job_id, record.resume_count) for record in records}
    runs = instance.get_runs(filters=dg.RunsFilter(tags={JOB_ID_TAG: list(signed)}))
    return {
        run.tags[JOB_ID_TAG]: run.run_id
        for run in reversed(runs)  # newest last: it wins
        if run.tags.get(LAUNCH_TAG) == signed.get(run.tags[JOB_ID_TAG])
    }


def run_request_for(record: JobRecord, priority_cap: int | None, key: bytes) -> dg.RunRequest:
    """The job's run request (this sensor's, and a schedule tick's), checked as the daemon will check it
    when it creates the run (the request by the contract, the run config by the job's config schema, the
    tags as storable text), so that what is yielded cannot fail the tick for every job. Signed with the
    instance's launch `key`: the run it makes is the job's (pipeline/runs.py)."""
    try:
        # From Python's parse of the row, not pydantic's JSON: it reads what an older release stored (a lone
        # surrogate escape) and the contract then names the field.
        request = StoredRequest.model_validate(record.request)
    except ValidationError as exc:
        raise ValueError(f"invalid request: {describe_validation_error(exc)}") from None
    tags = run_tags(record, priority_cap)
    if problem := wire_value_problem(tags):
        raise ValueError(f"run tags (labels, model): {problem}")
    tags[LAUNCH_TAG] = launch_signature(key, record.job_id, record.resume_count)
    run_config = run_config_for(request)
    dg.validate_run_config(batch_completions, run_config)  # DagsterInvalidConfigError names the field
    return dg.RunRequest(run_key=run_key(record), run_config=run_config, tags=tags)


def _reconcile(instance: dg.DagsterInstance, store: JobStore) -> None:
    job_of_run = {run_id: job_id for job_id, run_id in store.unfinished_with_runs()}
    if not job_of_run:
        return
    now = datetime.now(UTC).timestamp()
    for record in instance.get_run_records(filters=dg.RunsFilter(run_ids=list(job_of_run))):
        if record.dagster_run.is_finished and record.end_time and now - record.end_time >= RECONCILE_AFTER_S:
            # Too late to keep partial results by a job; the row names the run, so the job is the row's.
            record_run_end(instance, store, record.dagster_run, job_of_run[record.dagster_run.run_id])


def _shortened(exc: Exception) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text if len(text) <= 2000 else text[:2000] + "..."


def failure_reason(instance: dg.DagsterInstance, run_id: str) -> str:
    """Why a run failed, as its users should read it: a dg.Failure's description, else the error; for a run
    failed from outside its steps, an unreachable code location where that is what stopped it."""
    failures = instance.all_logs(run_id, of_type={DagsterEventType.STEP_FAILURE, DagsterEventType.RUN_FAILURE})
    for entry in failures:
        event = entry.dagster_event
        if event and event.is_step_failure:
            user_failure = event.step_failure_data.user_failure_data
            if user_failure and user_failure.description:
                return user_failure.description
            if event.step_failure_data.error:
                return event.step_failure_data.error.message.strip()
    if (outage := outage_error(instance, run_id)) is not None:
        return describe_outage(*outage)
    return failures[-1].message if failures else "the run failed"


def _end_time(instance: dg.DagsterInstance, run_id: str) -> datetime:
    record = instance.get_run_record_by_id(run_id)
    if record is not None and record.end_time:
        return datetime.fromtimestamp(record.end_time, UTC)
    return datetime.now(UTC)


def _parent_completed(instance: dg.DagsterInstance, run: dg.DagsterRun) -> bool:
    return is_retry_of_completed(run, instance.get_run_by_id(run.parent_run_id) if run.parent_run_id else None)


def record_run_end(
    instance: dg.DagsterInstance,
    store: JobStore,
    run: dg.DagsterRun,
    job_id: str | None = None,
    launches_partial_results: bool = False,
) -> dg.RunRequest | None:
    """How a finished run of a job (the run's own, unless given) ended, into the job's row: completed;
    failed with the step's reason (or still running, when Dagster retries the run); cancelled, or failed
    when run monitoring stopped it at its deadline. Returns the run that keeps a stopped run's finished
    results, if one is needed. `launches_partial_results`: the caller launches that run (the status
    sensors), so the end's webhook event waits for it to write the output."""
    if job_id is None:
        job_id = job_id_of(instance, run)
        claimed = store.get(job_id)
        if claimed is not None and not_the_run_of(instance, run, claimed) is not None:
            return None  # a run merely tagged with the job's id: its end is not the job's
    if run.status == dg.DagsterRunStatus.CANCELED and _parent_completed(instance, run):
        return None  # a retry not run, its parent's worker having completed the job (LocalRunLauncher)
    ended_at = _end_time(instance, run.run_id)

    def stopped(record: JobRecord | None, status: str, failure: str | None, entry: tuple[str, str]):
        """A run stopped before the end: the job's end (`failure` its reason), and the run that keeps its
        finished results, each unfinished request's entry `entry` (code, message)."""
        keeping = launches_partial_results and keeps_partial_results(record)
        held = store.mark_run_ended(job_id, run.run_id, status, ended_at, failure, keeping_partial_results=keeping)
        return partial_results_run_request(record, run.run_id, *entry, held_event=held if keeping else None)

    def failed(record: JobRecord | None, why: str):
        return stopped(
            record, JobStatus.FAILED, why, ("job_failed", f"the job failed before this request finished: {why}")
        )

    if run.status == dg.DagsterRunStatus.SUCCESS:
        store.mark_run_ended(job_id, run.run_id, JobStatus.COMPLETED, ended_at)
        return None
    if run.status == dg.DagsterRunStatus.FAILURE:
        reason = failure_reason(instance, run.run_id)
        if run.tags.get(WILL_RETRY_TAG) == "true" or run.tags.get(AUTO_RETRY_RUN_ID_TAG):
            # The daemon retries it (or has: a later failure of the same run, its worker still running after
            # the run was failed from outside, reads will_retry=false though the retry is launched): the retry
            # writes the whole output, or keeps these results if it fails too.
            ended_long_ago = (datetime.now(UTC) - ended_at).total_seconds() >= RECONCILE_AFTER_S
            missed = retry_missed_read(instance, run) if ended_long_ago else None
            if missed == "given up":  # the job must not read running for ever, holding its team's slot
                why = f"{reason}; Dagster's run retry daemon never retried the run, handed back {MAX_RETRIES} times"
                return failed(store.get(job_id), why)
            if missed == "handed back":
                reason = f"{reason}; its retry was not launched, so the run is handed to the run retry daemon again"
            store.mark_retrying(job_id, run.run_id, reason)
            return None
        if (outage := retry_after_outage(instance, run)) is not None:
            store.mark_retrying(job_id, run.run_id, outage)
            return None
        return failed(store.get(job_id), reason)
    record = store.get(job_id)
    if record is not None and record.cancelled_at is None and ended_at >= record.expires_at:
        # Nobody cancelled it: Dagster's run monitoring stopped a run past its max_runtime.
        return failed(record, "max_runtime_sec exceeded: the run was stopped by run monitoring")
    cancelled = ("cancelled", "the job was cancelled before this request finished")
    return stopped(record, JobStatus.CANCELLED, None, cancelled)


def run_end_sensors(interval_s: int) -> list[dg.SensorDefinition]:
    """The sensors that record how each run ended in its job's row, evaluated at most every `interval_s`
    seconds."""

    @dg.run_status_sensor(
        run_status=dg.DagsterRunStatus.SUCCESS,
        monitored_jobs=[batch_completions],
        default_status=dg.DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=interval_s,
        description="A succeeded run's job reads completed (its results were recorded by write_job_metadata).",
    )
    def record_succeeded_runs(context: RunStatusSensorContext, job_store: JobStoreResource):
        record_run_end(context.instance, job_store.get_store(), context.dagster_run)

    @dg.run_status_sensor(
        run_status=dg.DagsterRunStatus.CANCELED,
        monitored_jobs=[batch_completions],
        request_job=keep_partial_results,
        default_status=dg.DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=interval_s,
        description="A cancelled run's job reads cancelled (or failed, when its deadline stopped it), and the "
        "results its shards finished are merged into its output by keep_partial_results.",
    )
    def record_stopped_runs(context: RunStatusSensorContext, job_store: JobStoreResource):
        return record_run_end(
            context.instance, job_store.get_store(), context.dagster_run, launches_partial_results=True
        )

    @dg.run_failure_sensor(
        monitored_jobs=[batch_completions],
        request_job=keep_partial_results,
        default_status=dg.DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=interval_s,
        description="A failed run's job reads failed with the reason (or running, while Dagster retries the "
        "run), and the results its shards finished are merged into its output by keep_partial_results.",
    )
    def record_failed_runs(context: dg.RunFailureSensorContext, job_store: JobStoreResource):
        run = context.instance.get_run_by_id(context.dagster_run.run_id) or context.dagster_run  # with will_retry
        return record_run_end(context.instance, job_store.get_store(), run, launches_partial_results=True)

    return [record_succeeded_runs, record_stopped_runs, record_failed_runs]
