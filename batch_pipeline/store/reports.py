"""The deployment's figures over every job: what /metrics exports, the usage report by team and day
(GET /v2/usage), and the completed jobs' throughput that a dry run's estimate learns from."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from batch_pipeline.store.engine import StoreBase
from batch_pipeline.store.quotas import WORK_DIR_BYTES
from batch_pipeline.store.results import CompletedFigures, JobResults
from batch_pipeline.store.schema import (
    JobStatus,
    job_shards,
    jobs,
)
from batch_pipeline.store.sql import json_scalar, owner_bucket, seconds_between, utc, utc_day

_FIGURES = ("requests_done", "prompt_tokens", "completion_tokens")  # what usage and /metrics sum
_CACHED = ("cached_requests", "cached_prompt_tokens", "cached_completion_tokens")  # of those, from the result cache


@dataclass(frozen=True)
class WorkByDay:
    """Jobs' work summed for an owner (None: every owner not named) and a UTC day ("YYYY-MM-DD"), for one
    hardware shape: the `gpus` and `cpus` their stored requests ask for (None: not given), as the database
    reads them from the JSON (a number or a string). `shard_seconds` are of the shards of which the launcher
    has not said what it gave them (sized by that shape); `charged_seconds` of the others, already times
    what each was given."""

    owner: str | None
    day: str
    gpus: Any
    cpus: Any
    requests_done: int
    prompt_tokens: int
    completion_tokens: int
    shard_seconds: float
    charged_seconds: float = 0.0
    # Of requests_done and the tokens: answered from the team's result cache, computed by earlier jobs.
    cached_requests: int = 0
    cached_prompt_tokens: int = 0
    cached_completion_tokens: int = 0


class ReportStore(StoreBase):
    """Figures summed over the jobs at its URL (`JobStore`'s database), for reports: grouped in SQL,
    so that a report costs rows of owners x days, not of jobs."""

    def counts_by_status_model_and_kind(self) -> list[tuple[str, str, str | None, int, int, int, int]]:
        """(status, model, request kind, jobs, requests done, prompt tokens, completion tokens) over every job;
        the kind None where it is not known yet (an input file not planned) or was never recorded."""
        query = sa.select(
            jobs.c.status,
            sa.func.coalesce(jobs.c.model, ""),
            jobs.c.request_kind,
            sa.func.count(),
            sa.func.coalesce(sa.func.sum(jobs.c.requests_done), 0),
            sa.func.coalesce(sa.func.sum(jobs.c.prompt_tokens), 0),
            sa.func.coalesce(sa.func.sum(jobs.c.completion_tokens), 0),
        ).group_by(jobs.c.status, jobs.c.model, jobs.c.request_kind)
        with self.engine.connect() as connection:
            return [tuple(row) for row in connection.execute(query)]

    def engine_pool_figures(self) -> tuple[int, int, float]:
        """(warm, cold, engine-seconds saved) over the shards that ran in the warm engine pool."""
        query = sa.select(
            sa.func.count().filter(job_shards.c.engine_warm.is_(True)),
            sa.func.count().filter(job_shards.c.engine_warm.is_(False)),
            sa.func.coalesce(sa.func.sum(job_shards.c.engine_start_saved_s), 0.0),
        )
        with self.engine.connect() as connection:
            warm, cold, saved = connection.execute(query).one()
        return int(warm), int(cold), float(saved)

    def oldest_queued_created_at(self) -> datetime | None:
        query = sa.select(sa.func.min(jobs.c.created_at)).where(jobs.c.status == JobStatus.QUEUED)
        with self.engine.connect() as connection:
            return utc(connection.execute(query).scalar())

    def queue_wait_buckets(self, bounds: Iterable[float]) -> tuple[list[int], int, float]:
        """Jobs whose run started, counted at or under each bound of their wait from submission to start;
        with the count and the sum of all waits (a Prometheus histogram's figures)."""
        bounds = list(bounds)
        started = jobs.c.queue_wait_s.is_not(None)
        query = sa.select(
            *(sa.func.coalesce(sa.func.sum(sa.case((jobs.c.queue_wait_s <= b, 1), else_=0)), 0) for b in bounds),
            sa.func.count(),
            sa.func.coalesce(sa.func.sum(jobs.c.queue_wait_s), 0.0),
        ).where(started)
        with self.engine.connect() as connection:
            row = connection.execute(query).one()
        return [int(v) for v in row[: len(bounds)]], int(row[-2]), float(row[-1])

    def figures_by_team(self, named: Collection[str]) -> list[tuple[str | None, str, int, int, int, int]]:
        """(owner, status, jobs, requests done, prompt tokens, completion tokens) over every job, by owner
        of `named` and status; every other owner's jobs summed as one owner, None: at most
        (len(named) + 1) x statuses rows, however many owners there were."""
        per_job = sa.select(
            owner_bucket(jobs.c.owner, named).label("owner"),
            jobs.c.status,
            jobs.c.requests_done,
            jobs.c.prompt_tokens,
            jobs.c.completion_tokens,
        ).subquery()
        query = sa.select(
            per_job.c.owner,
            per_job.c.status,
            sa.func.count(),
            *(sa.func.coalesce(sa.func.sum(per_job.c[name]), 0) for name in _FIGURES),
        ).group_by(per_job.c.owner, per_job.c.status)
        with self.engine.connect() as connection:
            return [
                (owner, status, int(count), int(a), int(b), int(c))
                for owner, status, count, a, b, c in connection.execute(query)
            ]

    def completed_figures(self, model: str, limit: int = 20) -> list[CompletedFigures]:
        """The newest `limit` completed jobs of a model, newest first: each one's `results` (its
        completion_tokens, completion_tokens_per_s, wall_s, num_requests, ...) with `shards`, the shard
        workers it ran in. Every owner's jobs: throughput is the deployment's, and no job is named."""
        shards = (
            sa.select(sa.func.count()).where(job_shards.c.job_id == jobs.c.job_id).correlate(jobs).scalar_subquery()
        )
        # created_at, not completed_at: the (status, created_at) index serves the order.
        query = (
            sa.select(jobs.c.results, shards.label("shards"))
            .where(jobs.c.status == JobStatus.COMPLETED, jobs.c.model == model[:256], jobs.c.results.is_not(None))
            .order_by(jobs.c.created_at.desc())
            .limit(limit)
        )
        with self.engine.connect() as connection:
            return [
                CompletedFigures(results=JobResults.from_column(row.results), shards=row.shards)
                for row in connection.execute(query)
            ]

    def work_by_day(
        self, since: datetime, until: datetime, now: datetime, owner: str | None, named: Collection[str]
    ) -> list[WorkByDay]:
        """The work of jobs in [since, until), summed by owner and UTC day: each job's requests done, prompt
        and completion tokens, and shard-seconds (its run slots' hold as fair share counts it: the seconds
        its runs ran, each from its start to its end or now, times its shards: those the launcher charged,
        times what it gave each, in `charged_seconds`; the rest, at least one, in `shard_seconds`) on the day
        it ended, or today while it runs; grouped too by its request's `gpus` and `cpus`, for the caller to
        size the shards the launcher did not charge.
        `owner`: that owner's jobs only; owners outside `named` are summed as one, owner None. At most
        days x (len(named) + 1) x the hardware shapes asked for rows."""
        now = now.astimezone(UTC)
        stamp = sa.literal(now, sa.DateTime(timezone=True))
        of_job = job_shards.c.job_id == jobs.c.job_id
        charged = job_shards.c.charged_units.is_not(None)
        uncharged = sa.select(sa.func.count()).where(of_job, ~charged).correlate(jobs).scalar_subquery()
        any_shard = sa.select(sa.func.count()).where(of_job).correlate(jobs).scalar_subquery()
        charged_units = (
            sa.select(sa.func.coalesce(sa.func.sum(job_shards.c.charged_units), 0.0))
            .where(of_job)
            .correlate(jobs)
            .scalar_subquery()
        )
        end = sa.func.coalesce(jobs.c.completed_at, stamp)
        run_start = sa.func.coalesce(jobs.c.run_started_at, jobs.c.started_at)
        held = sa.func.coalesce(jobs.c.earlier_runs_s, 0.0) + sa.case(
            (sa.and_(run_start.is_not(None), end > run_start), seconds_between(run_start, end)), else_=0.0
        )
        # A job with no shards recorded yet holds one slot, sized by its request.
        unsized = sa.case((any_shard == 0, 1), else_=uncharged)
        counted: Any = sa.and_(jobs.c.completed_at >= since, jobs.c.completed_at < until)
        if since <= now < until:  # today is in the range: the jobs running now count on it
            counted = sa.or_(counted, sa.and_(jobs.c.completed_at.is_(None), jobs.c.started_at.is_not(None)))
        per_job = sa.select(
            owner_bucket(jobs.c.owner, named).label("owner"),
            sa.case(
                (jobs.c.completed_at.is_(None), sa.literal(now.date().isoformat())), else_=utc_day(jobs.c.completed_at)
            ).label("day"),
            json_scalar(jobs.c.request, "gpus").label("gpus"),
            json_scalar(jobs.c.request, "cpus").label("cpus"),
            *(sa.func.coalesce(jobs.c[name], 0).label(name) for name in (*_FIGURES, *_CACHED)),
            (held * unsized).label("shard_seconds"),
            (held * charged_units).label("charged_seconds"),
        ).where(counted)
        if owner is not None:
            per_job = per_job.where(jobs.c.owner == owner)
        grouped = per_job.subquery()
        keys = (grouped.c.owner, grouped.c.day, grouped.c.gpus, grouped.c.cpus)
        query = sa.select(
            *keys,
            *(sa.func.sum(grouped.c[name]) for name in _FIGURES),
            sa.func.sum(grouped.c.shard_seconds),
            sa.func.sum(grouped.c.charged_seconds),
            *(sa.func.sum(grouped.c[name]) for name in _CACHED),
        ).group_by(*keys)
        with self.engine.connect() as connection:
            return [
                WorkByDay(
                    row[0],
                    str(row[1]),
                    row[2],
                    row[3],
                    int(row[4]),
                    int(row[5]),
                    int(row[6]),
                    float(row[7]),
                    float(row[8] or 0),
                    *(int(row[9 + k] or 0) for k in range(len(_CACHED))),
                )
                for row in connection.execute(query)
            ]

    def submissions_by_day(
        self, since: datetime, until: datetime, owner: str | None, named: Collection[str]
    ) -> list[tuple[str | None, str, int, int]]:
        """(owner, UTC day, jobs submitted, bytes their work dirs store: inline content and checkpoints) for
        jobs submitted in [since, until); owners outside `named` summed as one, None."""
        per_job = sa.select(
            owner_bucket(jobs.c.owner, named).label("owner"),
            utc_day(jobs.c.created_at).label("day"),
            WORK_DIR_BYTES.label("stored_bytes"),
        ).where(jobs.c.created_at >= since, jobs.c.created_at < until)
        if owner is not None:
            per_job = per_job.where(jobs.c.owner == owner)
        grouped = per_job.subquery()
        query = sa.select(
            grouped.c.owner,
            grouped.c.day,
            sa.func.count(),
            sa.func.coalesce(sa.func.sum(grouped.c.stored_bytes), 0),
        ).group_by(grouped.c.owner, grouped.c.day)
        with self.engine.connect() as connection:
            return [(row[0], str(row[1]), int(row[2]), int(row[3])) for row in connection.execute(query)]

    def work_dir_bytes_by_owner(self, owner: str | None, named: Collection[str]) -> dict[str | None, int]:
        """The bytes each owner's jobs store in their work dirs (`work_dir_bytes_of`, by owner of `named`;
        every other owner's summed as None)."""
        per_job = sa.select(owner_bucket(jobs.c.owner, named).label("owner"), WORK_DIR_BYTES.label("stored_bytes"))
        if owner is not None:
            per_job = per_job.where(jobs.c.owner == owner)
        grouped = per_job.subquery()
        query = sa.select(grouped.c.owner, sa.func.coalesce(sa.func.sum(grouped.c.stored_bytes), 0)).group_by(
            grouped.c.owner
        )
        with self.engine.connect() as connection:
            return {bucket: int(total) for bucket, total in connection.execute(query)}
