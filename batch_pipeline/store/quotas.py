"""A team's figures that its quotas are counted against (jobs queued, tokens of the day, bytes stored),
and the admission lock under which a job is counted and taken in one transaction."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa

from batch_pipeline.store.engine import StoreBase
from batch_pipeline.store.schema import (
    JobStatus,
    jobs,
)

# What a team stores of a job's work dir: the inline content written at submission, and its checkpoints.
WORK_DIR_BYTES = sa.func.coalesce(jobs.c.content_bytes, 0) + sa.func.coalesce(jobs.c.checkpoint_bytes, 0)


@dataclass(frozen=True)
class TokensOfTheDay:
    """An owner's tokens of a day: `used`, the prompt and completion tokens of its jobs that ended in it and
    what its jobs not yet ended have used so far; `reserved`, what those not yet ended are estimated to use
    past that (`estimated_tokens`). `held`, both, is what its `max_tokens_per_day` is counted against."""

    used: int
    reserved: int

    @property
    def held(self) -> int:
        return self.used + self.reserved


class TeamFigures:
    """An owner's figures as admission counts them, read in the transaction that holds its admission lock
    (`JobStore.create`'s or `resume`'s `admit`), so that the job it admits is counted by the next."""

    def __init__(self, connection: sa.Connection, owner: str) -> None:
        self._connection = connection
        self.owner = owner

    def queued(self) -> int:
        return _count_queued(self._connection, self.owner)

    def tokens_since(self, since: datetime) -> TokensOfTheDay:
        return _tokens_held_since(self._connection, self.owner, since)


Admit = Callable[[TeamFigures], None]
# Postgres: the admission lock's class (the first key of pg_advisory_xact_lock); the second is the owner's hash.
_ADMISSION_LOCK_CLASS = 0x62617463  # "batc"


@contextlib.contextmanager
def admitting(engine: sa.Engine, owner: str) -> Iterator[sa.Connection]:
    """A transaction that holds `owner`'s admission lock from before its first read to its commit: on
    Postgres an advisory lock of the owner's; on SQLite the database's write lock (BEGIN IMMEDIATE), taken
    before the count, so that a second writer waits for it rather than count what the first is adding."""
    with engine.connect() as connection, connection.begin():
        if connection.dialect.name == "sqlite":
            connection.exec_driver_sql("BEGIN IMMEDIATE")
        elif connection.dialect.name == "postgresql":
            connection.execute(
                sa.text("SELECT pg_advisory_xact_lock(:lock_class, hashtext(:owner))"),
                {"lock_class": _ADMISSION_LOCK_CLASS, "owner": owner},
            )
        else:
            raise NotImplementedError(f"no admission lock for a {connection.dialect.name} job store")
        yield connection


class QuotaStore(StoreBase):
    """The figures of each team that its quotas count, at its URL (`JobStore`'s database)."""

    def count_queued(self, owner: str) -> int:
        """How many of `owner`'s jobs wait to start (queued, with or without a run yet)."""
        with self.engine.connect() as connection:
            return _count_queued(connection, owner)

    def tokens_held_since(self, owner: str, since: datetime) -> TokensOfTheDay:
        """`owner`'s tokens since `since` as its max_tokens_per_day counts them (`TokensOfTheDay`): those of
        its jobs that ended since, and of each not yet ended (waiting, running, or resumed and waiting again)
        the larger of its estimate and what it has used so far."""
        with self.engine.connect() as connection:
            return _tokens_held_since(connection, owner, since)

    def hold_planned_tokens(
        self, job_id: str, owner: str, tokens: int, limit: int, since: datetime
    ) -> TokensOfTheDay | None:
        """The job's reservation made its planned shards' `tokens`, under its owner's admission lock, unless
        the owner's other jobs already hold its `limit` of the day since `since`: then nothing changes, and
        their figures are returned. A file's estimate at submission is its size, unread; a file can grow
        before its job reads it: what the plan read is what counts."""
        with admitting(self.engine, owner) as connection:
            others = _tokens_held_since(connection, owner, since, excluding=job_id)
            if others.held >= limit:
                return others
            connection.execute(jobs.update().where(jobs.c.job_id == job_id).values(estimated_tokens=tokens))
        return None

    def work_dir_bytes_of(self, owner: str) -> int:
        """The bytes `owner`'s jobs store in their work dirs: inline content and checkpoints, until retention
        deletes them (jobs of older releases, which did not record them, count none)."""
        query = sa.select(sa.func.coalesce(sa.func.sum(WORK_DIR_BYTES), 0)).where(jobs.c.owner == owner)
        with self.engine.connect() as connection:
            return int(connection.execute(query).scalar_one())

    def tokens_since(self, owner: str, since: datetime) -> int:
        """Prompt plus completion tokens of `owner`'s jobs that ended at or after `since`, and of those still
        running: a job's figures are totals, counted on the day it ends (today while it runs)."""
        ran = sa.or_(
            jobs.c.completed_at >= since, sa.and_(jobs.c.completed_at.is_(None), jobs.c.started_at.is_not(None))
        )
        tokens = sa.func.coalesce(jobs.c.prompt_tokens, 0) + sa.func.coalesce(jobs.c.completion_tokens, 0)
        query = sa.select(sa.func.coalesce(sa.func.sum(tokens), 0)).where(jobs.c.owner == owner, ran)
        with self.engine.connect() as connection:
            return int(connection.execute(query).scalar_one())


def _count_queued(connection: sa.Connection, owner: str) -> int:
    query = sa.select(sa.func.count()).select_from(jobs).where(jobs.c.owner == owner, jobs.c.status == JobStatus.QUEUED)
    return int(connection.execute(query).scalar_one())


def _tokens_held_since(
    connection: sa.Connection, owner: str, since: datetime, excluding: str | None = None
) -> TokensOfTheDay:
    spent = sa.func.coalesce(jobs.c.prompt_tokens, 0) + sa.func.coalesce(jobs.c.completion_tokens, 0)
    estimate = sa.func.coalesce(jobs.c.estimated_tokens, 0)
    beyond = sa.case((estimate > spent, estimate - spent), else_=0)
    mine = jobs.c.owner == owner if excluding is None else sa.and_(jobs.c.owner == owner, jobs.c.job_id != excluding)
    # Three reads, each of an index's rows: the ended, the running (no end), the waiting again after an end.
    ended = sa.select(spent.label("used"), sa.literal(0).label("reserved")).where(
        mine, jobs.c.completed_at >= since, jobs.c.status != JobStatus.QUEUED
    )
    running = sa.select(spent, beyond).where(mine, jobs.c.completed_at.is_(None))
    resumed = sa.select(spent, beyond).where(mine, jobs.c.status == JobStatus.QUEUED, jobs.c.completed_at.is_not(None))
    both = sa.union_all(ended, running, resumed).subquery()
    query = sa.select(sa.func.coalesce(sa.func.sum(both.c.used), 0), sa.func.coalesce(sa.func.sum(both.c.reserved), 0))
    used, reserved = connection.execute(query).one()
    return TokensOfTheDay(int(used), int(reserved))
