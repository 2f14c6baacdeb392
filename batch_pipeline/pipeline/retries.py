"""Failed runs that Dagster's run retry daemon dropped are handed back to it, and their jobs say why.

The daemon reads each run failure event once, and drops a run for good in two ways:
- **An unreachable code location.** The queue waits out a short outage itself (max_user_code_failure_retries in
  dagster.yaml). What is left is a dequeue that ran out of those retries, and the daemon giving up on a run
  (`dagster/will_retry=false`) when the code location does not answer at the moment it retries.
- **A failure read too early.** The instance stores a run's failure event, then writes the run's status, then
  its `dagster/will_retry` tag. A daemon tick that reads the event in between sees a run that has not failed,
  skips it, and moves its cursor past it: the run reads will_retry=true and is never retried. Under load the
  gap is seconds (a soak saw 3 s).

Both are handed back the same way. The status sensors run in the code server, so when one of them reads such a
run the location is back. The run's failure is reported again, and the daemon reads it once more. It
re-executes from failure, so the job resumes from its checkpoints. This happens at most MAX_RETRIES times a run,
each at least the jobs sensor's reconcile delay apart (a new failure moves the run's end), and only where the
daemon would retry the run (its `dagster/max_retries` against the retries its run group holds), before the
job's deadline, and with no other run of the job unfinished: a job never has two live runs.

The outage is read from the daemon's own records, which are the run's: a step process that outlived its killed
run worker reports its own errors (its shard stopped), seconds after the daemon's under load (issue 50).
"""

from __future__ import annotations

import time
from typing import Literal

import dagster as dg
from dagster._core.execution.retries import auto_reexecution_should_retry_run
from dagster._core.storage.tags import AUTO_RETRY_RUN_ID_TAG, MAX_RETRIES_TAG, RETRY_NUMBER_TAG, WILL_RETRY_TAG
from dagster._utils.error import SerializableErrorInfo

from batch_pipeline.pipeline.tags import DEADLINE_TAG, JOB_ID_TAG

# The errors Dagster raises where a code server cannot be reached, or its code cannot be loaded.
UNREACHABLE_ERRORS = ("DagsterUserCodeUnreachableError", "DagsterCodeLocationLoadError")
RETRIES_TAG = "batch_pipeline/code_location_retries"
MAX_RETRIES = 5


def outage_error(instance: dg.DagsterInstance, run_id: str) -> tuple[str, SerializableErrorInfo] | None:
    """The newest engine event of the run itself (not of a step) that carries an error, with that error, where
    the error says the code location could not be reached: how the dequeue, the launch and the run retry
    daemon record giving up."""
    for record in reversed(instance.all_logs(run_id, of_type=dg.DagsterEventType.ENGINE_EVENT)):
        if record.step_key is not None:
            continue  # a step's own error, not the daemon's
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
    if not _may_hand_back(instance, run) or not _retries_left(run) or not _within_budget_and_deadline(instance, run):
        return None
    found = outage_error(instance, run.run_id)
    if found is None:
        return None
    why = describe_outage(*found)
    _hand_back(instance, run, f"{why}; it answers now: the run is handed to the run retry daemon again")
    return why


def retry_missed_read(instance: dg.DagsterInstance, run: dg.DagsterRun) -> Literal["handed back", "given up"] | None:
    """For a run that failed a while ago, reads will_retry=true, and has no retry: the daemon read its failure
    too early. Hand it back ("handed back"), or, handed back MAX_RETRIES times already, say "given up": its
    job fails. None for any other run (a retry launched, a re-execution of it from the UI, retries off). Only
    for runs whose end is older than a daemon tick."""
    if run.tags.get(WILL_RETRY_TAG) != "true" or not _may_hand_back(instance, run):
        return None
    if not _retries_left(run):
        return "given up"
    _hand_back(
        instance,
        run,
        "the run retry daemon read this failure before the run's status was written, and did not retry it: the "
        "failure is reported again for it",
    )
    return "handed back"


def _may_hand_back(instance: dg.DagsterInstance, run: dg.DagsterRun) -> bool:
    """Whether a failed run may be handed back at all: retries are on, and nothing re-executes it yet, neither
    the daemon's retry (its tag, or the run group where the tag lags) nor an operator's, which Dagster's retry
    daemon does not look for (a run handed back beside one would run the job twice in one work dir), nor any
    other run of its job (a resume's)."""
    if not instance.run_retries_enabled or run.tags.get(AUTO_RETRY_RUN_ID_TAG):
        return False
    group = instance.get_run_group(run.run_id)
    if group is not None and any(other.parent_run_id == run.run_id for other in group[1]):
        return False
    return not _other_unfinished_run(instance, run)


def _other_unfinished_run(instance: dg.DagsterInstance, run: dg.DagsterRun) -> bool:
    job_id = run.tags.get(JOB_ID_TAG)
    if job_id is None:
        return False
    unfinished = [status for status in dg.DagsterRunStatus if status not in _FINISHED]
    # Of the run's own Dagster job: a keep_partial_results run of the job writes no shard.
    of_job = dg.RunsFilter(job_name=run.job_name, tags={JOB_ID_TAG: job_id}, statuses=unfinished)
    runs = instance.get_run_ids(of_job, limit=2)
    return any(run_id != run.run_id for run_id in runs)


_FINISHED = (dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED)


def _within_budget_and_deadline(instance: dg.DagsterInstance, run: dg.DagsterRun) -> bool:
    """Whether the daemon would retry the run were it to fail now (its `dagster/max_retries` against the
    retries its run group holds), before the job's deadline: a run handed back past either only fails again."""
    deadline = run.tags.get(DEADLINE_TAG)
    if deadline is not None and time.time() >= float(deadline):
        return False
    return auto_reexecution_should_retry_run(instance, run, None)


def _handed_back(run: dg.DagsterRun) -> int:
    return int(run.tags.get(RETRIES_TAG, "0") or 0)


def _retries_left(run: dg.DagsterRun) -> bool:
    return _handed_back(run) < MAX_RETRIES and int(run.tags.get(MAX_RETRIES_TAG, "0") or 0) > 0


def _hand_back(instance: dg.DagsterInstance, run: dg.DagsterRun, message: str) -> None:
    instance.add_run_tags(run.run_id, {RETRIES_TAG: str(_handed_back(run) + 1)})
    # A run failure again: the instance sets dagster/will_retry from the run's retries left, and the run
    # retry daemon, which reads each run failure once, retries it.
    instance.report_run_failed(run, message)


def is_retry_of_completed(run: dg.DagsterRun, parent: dg.DagsterRun | None) -> bool:
    """Whether `run` is the run retry daemon's retry of `parent` (not an operator's re-execution, which may
    run a completed job again on purpose), `parent` having completed all the same: failed from outside while
    its worker ran on, which then completed it. Such a retry would only run the job a second time."""
    return (
        parent is not None
        and run.tags.get(RETRY_NUMBER_TAG) is not None
        and parent.status == dg.DagsterRunStatus.SUCCESS
    )
