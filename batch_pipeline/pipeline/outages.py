"""A run that failed because its code location could not be reached is retried once it answers again, and
its job says why it failed: the unreachable code server, not "marked as failed from outside".

The queue waits out a short outage itself (max_user_code_failure_retries in dagster.yaml). What is left: a
dequeue that ran out of those retries, and Dagster's run retry daemon, which gives up on a run for good
(`dagster/will_retry=false`) when the code location does not answer at the moment it retries. The status
sensors run in the code server, so when one of them reads such a run the location is back: the run's
failure is reported again, which hands it to the run retry daemon once more (it re-executes from
failure, so the job resumes from its checkpoints). At most MAX_RETRIES times a run, and each at least the
jobs sensor's reconcile delay apart.
"""

from __future__ import annotations

import dagster as dg
from dagster._core.storage.tags import AUTO_RETRY_RUN_ID_TAG, MAX_RETRIES_TAG
from dagster._utils.error import SerializableErrorInfo

# The errors Dagster raises where a code server cannot be reached, or its code cannot be loaded.
UNREACHABLE_ERRORS = ("DagsterUserCodeUnreachableError", "DagsterCodeLocationLoadError")
RETRIES_TAG = "batch_pipeline/code_location_retries"
MAX_RETRIES = 5


def outage_error(instance: dg.DagsterInstance, run_id: str) -> tuple[str, SerializableErrorInfo] | None:
    """The newest engine event of the run that carries an error, with that error, where the error says the
    code location could not be reached: how the dequeue and the run retry daemon record giving up."""
    for record in reversed(instance.all_logs(run_id, of_type=dg.DagsterEventType.ENGINE_EVENT)):
        event = record.dagster_event
        data = event.engine_event_data if event is not None else None
        if data is not None and data.error is not None:
            return (record.message, data.error) if _names_unreachable(data.error) else None
    return None


def _names_unreachable(error: SerializableErrorInfo | None) -> bool:
    while error is not None:
        if error.cls_name in UNREACHABLE_ERRORS:
            return True
        error = error.cause or error.context
    return False


def describe_outage(message: str, error: SerializableErrorInfo) -> str:
    first_line = error.message.strip().splitlines()[0] if error.message.strip() else error.cls_name or "error"
    return f"the code location could not be reached: {message} ({first_line[:500]})"


def retry_after_outage(instance: dg.DagsterInstance, run: dg.DagsterRun) -> str | None:
    """If the failed run gave up because its code location did not answer, and it may still be retried, hand
    it to the run retry daemon again and say why; else None."""
    if run.tags.get(AUTO_RETRY_RUN_ID_TAG) or not instance.run_retries_enabled:
        return None  # retried already, or retries are off
    retries = int(run.tags.get(RETRIES_TAG, "0") or 0)
    if retries >= MAX_RETRIES or int(run.tags.get(MAX_RETRIES_TAG, "0") or 0) <= 0:
        return None
    found = outage_error(instance, run.run_id)
    if found is None:
        return None
    why = describe_outage(*found)
    instance.add_run_tags(run.run_id, {RETRIES_TAG: str(retries + 1)})
    # A run failure again: the instance sets dagster/will_retry from the run's retries left, and the run
    # retry daemon, which reads each run failure once, retries it.
    instance.report_run_failed(run, f"{why}; it answers now: the run is handed to the run retry daemon again")
    return why
