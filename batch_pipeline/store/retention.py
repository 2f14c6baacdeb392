"""Retention's rows: which finished jobs' work dirs are due for deletion, the claim that marks one deleted
(`batch_jobs.work_dir_deleted_at`), and what a resume of such a job is told (`checkpoints_deleted`).

The `cleanup` schedule (`pipeline/cleanup.py`) claims a job's work dir before it deletes it: the claim
is one conditional update (the job still finished, ended before the cutoff, not yet claimed), so that a
job resumed meanwhile is never claimed, and a claimed one is never resumed (a resume checks the column in
its own conditional update). The job's content_bytes and checkpoint_bytes are 0 from then on: usage and
`max_stored_bytes` count what is still stored.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa

from batch_pipeline.store.schema import FINISHED, JOB_ID_LENGTH, jobs
from batch_pipeline.store.sql import of_owners, utc


@dataclass(frozen=True)
class DueWorkDir:
    """A finished job whose work dir is due for deletion: what the cleanup needs of its row."""

    job_id: str
    owner: str
    request_json: str
    content_bytes: int | None
    completed_at: datetime
    checkpoint_bytes: int | None = None


def due_work_dirs(
    engine: sa.Engine,
    ended_before: datetime,
    owners: Collection[str] | None = None,
    other_than: Collection[str] = (),
    limit: int = 500,
) -> list[DueWorkDir]:
    """Finished jobs that ended before `ended_before` whose work dir is not yet deleted, the oldest first:
    of `owners` (None: any owner) other than those of `other_than` (teams with a retention of their own)."""
    query = (
        sa.select(
            jobs.c.job_id, jobs.c.owner, jobs.c.request, jobs.c.content_bytes, jobs.c.completed_at,
            jobs.c.checkpoint_bytes,
        )
        .where(_due(ended_before, owners, other_than))
        .order_by(jobs.c.completed_at, jobs.c.job_id)
        .limit(limit)
    )  # fmt: skip
    with engine.connect() as connection:
        return [
            DueWorkDir(
                row.job_id, row.owner, row.request, row.content_bytes, utc(row.completed_at), row.checkpoint_bytes
            )
            for row in connection.execute(query)
        ]


def count_due_work_dirs(
    engine: sa.Engine, ended_before: datetime, owners: Collection[str] | None = None, other_than: Collection[str] = ()
) -> int:
    """How many work dirs `due_work_dirs` would list, without a limit: what a bounded cleanup left."""
    query = sa.select(sa.func.count()).select_from(jobs).where(_due(ended_before, owners, other_than))
    with engine.connect() as connection:
        return int(connection.execute(query).scalar_one())


def _due(ended_before: datetime, owners: Collection[str] | None, other_than: Collection[str]) -> sa.ColumnElement[bool]:
    return sa.and_(
        jobs.c.completed_at.is_not(None),
        jobs.c.completed_at < ended_before,
        jobs.c.status.in_([status.value for status in FINISHED]),
        jobs.c.work_dir_deleted_at.is_(None),
        of_owners(jobs.c.owner, owners, other_than),
    )


def claim_work_dir(engine: sa.Engine, job_id: str, ended_before: datetime, now: datetime) -> bool:
    """Mark the job's work dir deleted as of `now` (before it is deleted), if the job is still finished,
    ended before `ended_before` and not yet claimed: False, and nothing changed, otherwise."""
    condition = sa.and_(
        jobs.c.job_id == job_id,
        jobs.c.completed_at.is_not(None),
        jobs.c.completed_at < ended_before,
        jobs.c.status.in_([status.value for status in FINISHED]),
        jobs.c.work_dir_deleted_at.is_(None),
    )
    with engine.begin() as connection:
        changed = connection.execute(
            jobs.update().where(condition).values(work_dir_deleted_at=now, content_bytes=0, checkpoint_bytes=0)
        )
        return changed.rowcount > 0


def release_work_dir(
    engine: sa.Engine,
    job_id: str,
    claimed_at: datetime,
    content_bytes: int | None,
    checkpoint_bytes: int | None = None,
) -> None:
    """Undo `claim_work_dir` after the deletion failed (the next cleanup tries again)."""
    condition = sa.and_(jobs.c.job_id == job_id, jobs.c.work_dir_deleted_at == claimed_at)
    restored = {"content_bytes": content_bytes, "checkpoint_bytes": checkpoint_bytes}
    with engine.begin() as connection:
        connection.execute(jobs.update().where(condition).values(work_dir_deleted_at=None, **restored))


def work_dir_deleted_at(engine: sa.Engine, job_id: str) -> datetime | None:
    """When retention deleted the job's work dir; None while it is kept (or for no such job)."""
    if len(job_id) > JOB_ID_LENGTH or "\x00" in job_id:
        return None
    query = sa.select(jobs.c.work_dir_deleted_at).where(jobs.c.job_id == job_id)
    with engine.connect() as connection:
        return utc(connection.execute(query).scalar_one_or_none())


def checkpoints_deleted(engine: sa.Engine, job_id: str) -> str | None:
    """Why a resume of the job is refused (409) because retention deleted its work dir, or None: "the
    checkpoints were deleted on 2026-12-01 17:00:00 UTC ...". For the resume route; its own conditional
    update should also require `jobs.c.work_dir_deleted_at.is_(None)`, so that a cleanup between its read
    and its write is not missed."""
    deleted = work_dir_deleted_at(engine, job_id)
    if deleted is None:
        return None
    return (
        f"the checkpoints were deleted on {deleted:%Y-%m-%d %H:%M:%S} UTC: retention removes a finished job's work "
        "dir (its inline content, shard inputs and checkpoints) some days after it ended, so it cannot be resumed; "
        "its output was kept. Submit it again instead"
    )
