"""Run slots as fair share reads them: who holds them and for how long, who waits for one, and each team's
decayed usage of its ended jobs (`team_usage`), each job counted there once, as it ends."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from batch_pipeline.store.engine import StoreBase
from batch_pipeline.store.records import JobRecord
from batch_pipeline.store.schema import (
    JobStatus,
    job_shards,
    jobs,
    team_usage,
)
from batch_pipeline.store.sql import utc


@dataclass(frozen=True)
class SlotUse:
    """A job's hold on run slots: from `started_at` to its end (None: still running), over `shards` shards
    (0 before they are planned), each sized by what its launcher gave its worker or, for the shards of
    which the launcher has not said (`shards - charged_shards`), by its stored request's hardware.

    `started_at` is its latest run's start less `earlier_runs_s`, the seconds its earlier runs ran: a
    resumed job holds slots for as long as its runs ran, not through the time it sat stopped between them
    (its earlier runs are counted as if just before its latest, which decays them no more than they were)."""

    owner: str
    started_at: datetime
    ended_at: datetime | None
    shards: int
    request_json: str = field(repr=False)
    job_id: str = ""
    counted_until: datetime | None = None  # the end up to which its team's `team_usage` counts it
    charged_shards: int = 0
    charged_units: float = 0.0  # the sum of what the launcher gave those shards
    earlier_runs_s: float = 0.0


class SharingStore(StoreBase):
    """The run slots' holders and waiters at its URL (`JobStore`'s database): fair share's reads each
    tick, every one served by an index, and its one write."""

    def slot_usage_since(self, since: datetime) -> list[SlotUse]:
        """Each job that held run slots since `since` (running, or ended after it): what fair share counts."""
        return self._slot_uses(
            sa.and_(jobs.c.started_at.is_not(None), sa.or_(jobs.c.completed_at.is_(None), jobs.c.completed_at >= since))
        )

    def slot_holders(self) -> dict[str, int]:
        """How many jobs of each owner hold a run slot: running, or given a run that has not started yet."""
        holding = sa.or_(
            jobs.c.status == JobStatus.RUNNING, sa.and_(jobs.c.status == JobStatus.QUEUED, jobs.c.run_id.is_not(None))
        )
        query = sa.select(jobs.c.owner, sa.func.count()).where(holding).group_by(jobs.c.owner)
        with self.engine.connect() as connection:
            return {owner: int(count) for owner, count in connection.execute(query)}

    def waiting_for_admission(self) -> Iterator[tuple[str, str, str | None, object]]:
        """(job id, owner, priority as stored, created) of each queued job without a run, oldest first (then
        by job id): what admission reads of them, from the `ix_batch_jobs_waiting` index alone. `created` is
        the time as the database returns it, not parsed (a third of the read's cost on SQLite, where it is
        text): only equal for jobs created at the same instant, as the order says the rest."""
        created = sa.type_coerce(jobs.c.created_at, sa.String)
        query = (
            sa.select(jobs.c.job_id, jobs.c.owner, jobs.c.priority, created)
            .where(jobs.c.status == JobStatus.QUEUED, jobs.c.run_id.is_(None))
            .order_by(jobs.c.created_at, jobs.c.job_id)
        )
        with self.engine.connect() as connection:
            rows = connection.execute(query).all()
        return iter(rows)  # type: ignore[arg-type]  # Row[...] of these four columns

    def expired_waiting(self, now: datetime) -> list[tuple[str, str, datetime]]:
        """(job id, owner, deadline) of each queued job without a run whose deadline passed."""
        query = sa.select(jobs.c.job_id, jobs.c.owner, jobs.c.expires_at).where(
            jobs.c.status == JobStatus.QUEUED, jobs.c.run_id.is_(None), jobs.c.expires_at <= now
        )
        with self.engine.connect() as connection:
            return [(job_id, owner, utc(expires)) for job_id, owner, expires in connection.execute(query)]

    def waiting_records(self, job_ids: Iterable[str]) -> list[JobRecord]:
        """The records of those of these jobs still queued without a run, in the order asked."""
        wanted = list(job_ids)
        if not wanted:
            return []
        query = sa.select(jobs).where(
            jobs.c.job_id.in_(wanted), jobs.c.status == JobStatus.QUEUED, jobs.c.run_id.is_(None)
        )
        with self.engine.connect() as connection:
            by_id = {row.job_id: JobRecord.from_row(row) for row in connection.execute(query)}
        return [by_id[job_id] for job_id in wanted if job_id in by_id]

    def _slot_uses(self, condition: Any) -> list[SlotUse]:
        of_job = job_shards.c.job_id == jobs.c.job_id
        shards = sa.select(sa.func.count()).where(of_job).scalar_subquery()
        charged = job_shards.c.charged_units.is_not(None)
        charged_shards = sa.select(sa.func.count()).where(of_job, charged).scalar_subquery()
        charged_units = sa.select(sa.func.coalesce(sa.func.sum(job_shards.c.charged_units), 0.0)).where(of_job)
        query = sa.select(
            jobs.c.job_id, jobs.c.owner, jobs.c.started_at, jobs.c.run_started_at, jobs.c.earlier_runs_s,
            jobs.c.completed_at, jobs.c.request, shards, jobs.c.usage_counted_until, charged_shards,
            charged_units.scalar_subquery(),
        ).where(condition)  # fmt: skip
        with self.engine.connect() as connection:
            return [
                SlotUse(
                    row.owner,
                    utc(row.run_started_at or row.started_at) - timedelta(seconds=row.earlier_runs_s or 0.0),
                    utc(row.completed_at),
                    int(row[7] or 0),
                    row.request,
                    row.job_id,
                    utc(row.usage_counted_until),
                    int(row[9] or 0),
                    float(row[10] or 0.0),
                    float(row.earlier_runs_s or 0.0),
                )
                for row in connection.execute(query)
            ]

    def slot_usage_uncounted(self, since: datetime) -> list[SlotUse]:
        """The jobs that held run slots, ended at or after `since`, and are not counted in their team's
        usage yet."""
        return self._slot_uses(
            sa.and_(jobs.c.usage_counted_until.is_(None), jobs.c.completed_at >= since, jobs.c.started_at.is_not(None))
        )

    def slot_usage_running(self) -> list[SlotUse]:
        """The jobs holding run slots now (started, not ended); one run again after it ended (a retry or a
        re-execution) has the end its team's usage counted it up to."""
        return self._slot_uses(sa.and_(jobs.c.completed_at.is_(None), jobs.c.started_at.is_not(None)))

    def team_usage(self) -> dict[str, tuple[float, datetime]]:
        """Each team's usage row: its ended jobs' decayed slot-seconds, as they count at the time given."""
        with self.engine.connect() as connection:
            rows = connection.execute(sa.select(team_usage.c.owner, team_usage.c.usage, team_usage.c.as_of))
            return {owner: (float(usage), utc(as_of)) for owner, usage, as_of in rows}

    def count_slot_usage(
        self,
        usage: dict[str, tuple[float, datetime]],
        counted: Iterable[str],
        uncounted: Iterable[str],
        since: datetime,
    ) -> bool:
        """In one transaction: the teams' usage rows set to `usage`, the `counted` jobs (ended) marked as
        counted up to their end, the `uncounted` ones (running again) unmarked, and every job that ended
        without holding slots, or before `since`, marked as counted with nothing. False, and nothing
        written, where another writer counted or changed one of those jobs since they were read."""
        counted, uncounted = list(counted), list(uncounted)
        try:
            with self.engine.begin() as connection:
                self._count_slot_usage(connection, usage, counted, uncounted, since)
        except _Recounted:
            return False
        return True

    @staticmethod
    def _count_slot_usage(
        connection: sa.Connection,
        usage: dict[str, tuple[float, datetime]],
        counted: list[str],
        uncounted: list[str],
        since: datetime,
    ) -> None:
        connection.execute(
            jobs.update()
            .where(
                jobs.c.usage_counted_until.is_(None),
                jobs.c.completed_at.is_not(None),
                sa.or_(jobs.c.started_at.is_(None), jobs.c.completed_at < since),
            )
            .values(usage_counted_until=jobs.c.completed_at)
        )
        changed = 0
        for start in range(0, len(counted), 500):
            changed += connection.execute(
                jobs.update()
                .where(
                    jobs.c.job_id.in_(counted[start : start + 500]),
                    jobs.c.usage_counted_until.is_(None),
                    jobs.c.completed_at.is_not(None),
                )
                .values(usage_counted_until=jobs.c.completed_at)
            ).rowcount
        for start in range(0, len(uncounted), 500):
            changed += connection.execute(
                jobs.update()
                .where(
                    jobs.c.job_id.in_(uncounted[start : start + 500]),
                    jobs.c.usage_counted_until.is_not(None),
                    jobs.c.completed_at.is_(None),
                )
                .values(usage_counted_until=None)
            ).rowcount
        if changed != len(counted) + len(uncounted):
            raise _Recounted
        for owner, (value, as_of) in usage.items():
            row = {"usage": value, "as_of": as_of}
            if not connection.execute(team_usage.update().where(team_usage.c.owner == owner).values(**row)).rowcount:
                connection.execute(team_usage.insert().values(owner=owner, **row))

    def tokens_since_by_owner(self, owners: Collection[str], since: datetime) -> dict[str, int]:
        """`tokens_since` of each of these owners, in one grouped query (admission's read each tick; an
        owner with no such job is absent): the ended jobs from `ix_batch_jobs_owner_completed`, the running
        ones from `ix_batch_jobs_holding`, so that no waiting job is read."""
        wanted = list(owners)
        if not wanted:
            return {}
        tokens = sa.func.coalesce(jobs.c.prompt_tokens, 0) + sa.func.coalesce(jobs.c.completion_tokens, 0)
        ended = sa.select(jobs.c.owner, tokens.label("tokens")).where(
            jobs.c.owner.in_(wanted), jobs.c.completed_at >= since
        )
        running = sa.select(jobs.c.owner, tokens.label("tokens")).where(
            jobs.c.completed_at.is_(None), jobs.c.started_at.is_not(None), jobs.c.owner.in_(wanted)
        )
        both = sa.union_all(ended, running).subquery()
        query = sa.select(both.c.owner, sa.func.sum(both.c.tokens)).group_by(both.c.owner)
        with self.engine.connect() as connection:
            return {owner: int(total or 0) for owner, total in connection.execute(query)}


class _Recounted(Exception):
    """Another writer counted or changed a job's slot usage while it was being counted."""
