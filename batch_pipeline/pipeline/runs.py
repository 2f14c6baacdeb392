"""Which Dagster runs belong to which job: lookups on the instance by the tags the runs carry. Below the op
graph, so the API can find a job's run without building the job."""

from __future__ import annotations

import dagster as dg

from batch_pipeline.pipeline.tags import JOB_ID_TAG, RESUME_TAG

ROOT_RUN_ID_TAG = "dagster/root_run_id"  # Dagster's tag on every re-execution


def tagged_job_id(instance: dg.DagsterInstance, run: dg.DagsterRun) -> str | None:
    """The API's job id, on the run or on the run it re-executes (Dagster's Python API does not copy
    tags to a re-execution)."""
    if JOB_ID_TAG in run.tags:
        return run.tags[JOB_ID_TAG]
    root = instance.get_run_by_id(run.root_run_id) if run.root_run_id else None
    return root.tags.get(JOB_ID_TAG) if root is not None else None


def job_id_of(instance: dg.DagsterInstance, run: dg.DagsterRun) -> str:
    """The job id, else the id of the first run of this job, so a re-execution finds the work (and the
    checkpoints) of the run it re-executes."""
    return tagged_job_id(instance, run) or run.root_run_id or run.run_id


def find_run(instance: dg.DagsterInstance, job_id: str, resume_count: int | None = None) -> dg.DagsterRun | None:
    """The job's newest run: its own, or a re-execution of it (which need not carry the job's tags). For a
    job resumed `resume_count` times, a run of that resume only: None until the jobs sensor makes it."""
    tags = {JOB_ID_TAG: job_id} | ({RESUME_TAG: str(resume_count)} if resume_count else {})
    runs = instance.get_runs(filters=dg.RunsFilter(tags=tags), limit=1)
    if not runs:
        return None
    # Every re-execution is newer than the run it re-executes, and carries the first run's id as its root
    # (a tagged run that is itself a re-execution is among them): the newest of them is the job's newest run.
    first_run_id = runs[0].root_run_id or runs[0].run_id
    reexecutions = instance.get_runs(filters=dg.RunsFilter(tags={ROOT_RUN_ID_TAG: first_run_id}), limit=1)
    return reexecutions[0] if reexecutions else runs[0]
