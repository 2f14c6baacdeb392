"""Which Dagster runs belong to which job: lookups on the instance by the tags the runs carry. Below the op
graph, so the API can find a job's run without building the job.

A tag alone proves nothing: whoever launches a run (the launchpad, GraphQL) chooses its tags. A run is a
job's when the service launched it for that job: the jobs sensor, a schedule's tick and a registering
launchpad run sign the job id (and which resume) with the instance's launch key, which lives in the
instance's storage, never in a run; a retry or re-execution copies the signature, or re-executes a run
that carries it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import dagster as dg
from sqlalchemy.exc import IntegrityError

from batch_pipeline.pipeline.tags import JOB_ID_TAG, LAUNCH_TAG, RESUME_TAG
from batch_pipeline.store.records import JobRecord

ROOT_RUN_ID_TAG = "dagster/root_run_id"  # Dagster's tag on every re-execution
# Where the instance keeps its launch key: Dagster's key-value store, in the instance's run storage.
LAUNCH_KEY_NAME = "batch_pipeline/launch_key"


def tagged_job_id(instance: dg.DagsterInstance, run: dg.DagsterRun) -> str | None:
    """The API's job id, on the run or on the run it re-executes (Dagster's Python API does not copy
    tags to a re-execution). What the run claims, not yet what it is: see `not_the_run_of`."""
    if JOB_ID_TAG in run.tags:
        return run.tags[JOB_ID_TAG]
    root = instance.get_run_by_id(run.root_run_id) if run.root_run_id else None
    return root.tags.get(JOB_ID_TAG) if root is not None else None


def job_id_of(instance: dg.DagsterInstance, run: dg.DagsterRun) -> str:
    """The job id, else the id of the first run of this job, so a re-execution finds the work (and the
    checkpoints) of the run it re-executes."""
    return tagged_job_id(instance, run) or run.root_run_id or run.run_id


def launch_key(instance: dg.DagsterInstance, create: bool = True) -> bytes | None:
    """The instance's key for signing the runs it launches for jobs; made once, by whichever launcher needs
    it first (None where none exists and `create` is False: no run was ever signed)."""
    storage = instance.run_storage
    stored = storage.get_cursor_values({LAUNCH_KEY_NAME})
    if LAUNCH_KEY_NAME not in stored:
        if not create:
            return None
        _insert_if_absent(storage, LAUNCH_KEY_NAME, secrets.token_hex(32))
        stored = storage.get_cursor_values({LAUNCH_KEY_NAME})
    return bytes.fromhex(stored[LAUNCH_KEY_NAME])


def _insert_if_absent(storage: object, key: str, value: str) -> None:
    """Two launchers making the key at once (the sensor and a schedule's daemon) keep the first one: an
    upsert would let the second replace the key the first signed a run with."""
    from dagster._core.storage.runs.schema import KeyValueStoreTable
    from dagster._core.storage.runs.sql_run_storage import SqlRunStorage

    if not isinstance(storage, SqlRunStorage):
        storage.set_cursor_values({key: value})  # type: ignore[attr-defined]
        return
    try:
        with storage.connect() as connection:
            connection.execute(KeyValueStoreTable.insert().values(key=key, value=value))
    except IntegrityError:
        pass  # another process made it first: that one is the key


def launch_signature(key: bytes, job_id: str, resume_count: int | None) -> str:
    """The tag value that makes a run the run of job `job_id` (of its `resume_count`th resume)."""
    return hmac.new(key, f"{job_id}:{resume_count or 0}".encode(), hashlib.sha256).hexdigest()


def launch_tags(instance: dg.DagsterInstance, record: JobRecord) -> dict[str, str]:
    """The tags a launcher adds to the run it makes for the job `record`: its id and its signature."""
    key = launch_key(instance)
    assert key is not None  # made if missing
    return {JOB_ID_TAG: record.job_id, LAUNCH_TAG: launch_signature(key, record.job_id, record.resume_count)}


def not_the_run_of(
    instance: dg.DagsterInstance, run: dg.DagsterRun, record: JobRecord, key: bytes | None = None
) -> str | None:
    """Why `run` is not a run of the job `record`, or None when it is: a run the service launched for this
    job (and this resume of it), a retry or re-execution of one, or a re-execution of the run the job
    store links to the job (a run of a release that signed none). `key`: the launch key, if read already."""
    root = instance.get_run_by_id(run.root_run_id) if run.root_run_id else run
    if root is None:
        return f"the run it re-executes ({run.root_run_id}) is gone"
    signature = run.tags.get(LAUNCH_TAG) or root.tags.get(LAUNCH_TAG)
    key = key or launch_key(instance, create=False)
    if signature and key is not None:
        if hmac.compare_digest(signature, launch_signature(key, record.job_id, record.resume_count)):
            return None
    if record.run_id is not None:
        linked = run if record.run_id == run.run_id else instance.get_run_by_id(record.run_id)
        if linked is not None and (linked.root_run_id or linked.run_id) == (run.root_run_id or run.run_id):
            return None
    if signature:
        return "its launch tag was made for another job, or another resume of it"
    return "the service did not launch it for that job (a job-id tag alone makes no run a job's)"


def find_run(instance: dg.DagsterInstance, job_id: str, resume_count: int | None = None) -> dg.DagsterRun | None:
    """The job's newest run: its own, or a re-execution of it (which need not carry the job's tags). For a
    job resumed `resume_count` times, a run of that resume only: None until the jobs sensor makes it. A
    run tagged with the job's id but not launched for it (`not_the_run_of`) is none of them."""
    key = launch_key(instance, create=False)
    if key is None:
        return None
    tags = {JOB_ID_TAG: job_id, LAUNCH_TAG: launch_signature(key, job_id, resume_count)}
    tags |= {RESUME_TAG: str(resume_count)} if resume_count else {}
    runs = instance.get_runs(filters=dg.RunsFilter(tags=tags), limit=1)
    if not runs:
        return None
    # Every re-execution is newer than the run it re-executes, and carries the first run's id as its root
    # (a tagged run that is itself a re-execution is among them): the newest of them is the job's newest run.
    first_run_id = runs[0].root_run_id or runs[0].run_id
    reexecutions = instance.get_runs(filters=dg.RunsFilter(tags={ROOT_RUN_ID_TAG: first_run_id}), limit=1)
    return reexecutions[0] if reexecutions else runs[0]
