"""What a job's shards have done, as its run records it: the shards as planned, each one's counts,
checkpoint bytes and charge, and the job's totals over them; the summary of its output."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import sqlalchemy as sa

from batch_pipeline.shards.protocol import ENGINE_STARTING
from batch_pipeline.store.engine import StoreBase
from batch_pipeline.store.results import JobResults
from batch_pipeline.store.schema import (
    job_shards,
    jobs,
)
from batch_pipeline.store.sql import utc_now
from batch_pipeline.store.webhooks import release_held_event

_SHARD_FIGURES = ("requests_done", "errors", "prompt_tokens", "completion_tokens")


class ShardPhase(StrEnum):
    """Where a shard's current attempt is, as its step and its worker's reports say; the job row keeps the
    furthest of its shards' (`jobs.shard_phase`)."""

    LAUNCHED = "launched"  # its step started a worker (which imports vLLM, or waits for a pod)
    ENGINE = "engine"  # the worker reported ENGINE_STARTING: it is building its engine
    GENERATING = "generating"  # the worker reported again since: its engine is generating


_FURTHEST_FIRST = (ShardPhase.GENERATING, ShardPhase.ENGINE, ShardPhase.LAUNCHED)


class ShardProgressStore(StoreBase):
    """Each job's shards and their progress at its URL (`JobStore`'s database)."""

    def record_shards(
        self,
        job_id: str,
        requests_per_shard: dict[int, int],
        checkpoint_bytes: dict[int, int] | None = None,
        shard_plan: str | None = None,
        request_kind: str | None = None,
    ) -> None:
        """The job's shards as planned (again, on a retry): progress is counted against these totals, and
        `checkpoint_bytes` are what each shard's checkpoint holds already (a resumed job's). `shard_plan`
        is kept from the first run that records one: every later run of the job plans from it.
        `request_kind`: the kind of its requests the plan read (/metrics counts by it)."""
        checkpoint_bytes = checkpoint_bytes or {}
        with self.engine.begin() as connection:
            connection.execute(job_shards.delete().where(job_shards.c.job_id == job_id))
            connection.execute(
                job_shards.insert(),
                [
                    {
                        "job_id": job_id,
                        "shard_index": index,
                        "requests_total": total,
                        "checkpoint_bytes": checkpoint_bytes.get(index, 0),
                        "updated_at": utc_now(),
                    }
                    for index, total in requests_per_shard.items()
                ],
            )
            if shard_plan is not None:
                first = sa.and_(jobs.c.job_id == job_id, jobs.c.shard_plan.is_(None))
                connection.execute(jobs.update().where(first).values(shard_plan=shard_plan))
            if request_kind is not None:
                connection.execute(jobs.update().where(jobs.c.job_id == job_id).values(request_kind=request_kind))
            self._total_shards(connection, job_id)

    def record_shard_charge(self, job_id: str, shard_index: int, units: float | None) -> None:
        """What the launcher gave the shard's worker (its cores, a pod's limits), as the shard starts: the unit
        of its slot-seconds in fair share and usage from then on. None: the launcher cannot say; the shard
        is charged what its request asks, at least one slot."""
        with self.engine.begin() as connection:
            connection.execute(
                job_shards.update()
                .where(job_shards.c.job_id == job_id, job_shards.c.shard_index == shard_index)
                .values(charged_units=units, phase=ShardPhase.LAUNCHED.value)
            )
            self._total_shards(connection, job_id)

    def record_shard_progress(self, job_id: str, shard_index: int, figures: dict[str, int]) -> None:
        """A shard worker's latest counts (absolute, not increments), and the job's totals with them."""
        values: dict[str, Any] = {name: int(figures[name]) for name in _SHARD_FIGURES if name in figures}
        if figures.get(ENGINE_STARTING):
            values["phase"] = ShardPhase.ENGINE.value
        else:  # a report after the engine's start is of generation
            engine = job_shards.c.phase == ShardPhase.ENGINE.value
            values["phase"] = sa.case((engine, ShardPhase.GENERATING.value), else_=job_shards.c.phase)
        with self.engine.begin() as connection:
            connection.execute(
                job_shards.update()
                .where(job_shards.c.job_id == job_id, job_shards.c.shard_index == shard_index)
                .values(**values, updated_at=utc_now())
            )
            self._total_shards(connection, job_id)

    def record_shard_engine(self, job_id: str, shard_index: int, warm: bool, start_saved_s: float) -> None:
        """A completed shard that ran in the warm engine pool: whether its engine was warm, and what that saved."""
        with self.engine.begin() as connection:
            connection.execute(
                job_shards.update()
                .where(job_shards.c.job_id == job_id, job_shards.c.shard_index == shard_index)
                .values(engine_warm=warm, engine_start_saved_s=start_saved_s)
            )

    def record_checkpoint_bytes(self, job_id: str, shard_index: int, checkpoint_bytes: int) -> None:
        """What a shard's checkpoint holds as one of its attempts ended, and the job's total with it."""
        with self.engine.begin() as connection:
            connection.execute(
                job_shards.update()
                .where(job_shards.c.job_id == job_id, job_shards.c.shard_index == shard_index)
                .values(checkpoint_bytes=checkpoint_bytes, updated_at=utc_now())
            )
            self._total_shards(connection, job_id)

    @staticmethod
    def _total_shards(connection: sa.Connection, job_id: str) -> None:
        def total(name: str) -> Any:
            return (
                sa.select(sa.func.coalesce(sa.func.sum(job_shards.c[name]), 0))
                .where(job_shards.c.job_id == job_id)
                .scalar_subquery()
            )

        def any_shard(phase: ShardPhase) -> Any:
            return sa.exists().where(job_shards.c.job_id == job_id, job_shards.c.phase == phase.value)

        connection.execute(
            jobs.update()
            .where(jobs.c.job_id == job_id)
            .values(
                shard_phase=sa.case(*((any_shard(phase), phase.value) for phase in _FURTHEST_FIRST), else_=None),
                requests_total=total("requests_total"),
                # Not once retention deleted the work dir: nothing is stored any more.
                checkpoint_bytes=sa.case((jobs.c.work_dir_deleted_at.is_(None), total("checkpoint_bytes")), else_=0),
                **{name: total(name) for name in _SHARD_FIGURES},
            )
        )

    def record_results(self, job_id: str, run_id: str, results: JobResults, held_event: str | None = None) -> None:
        """The summary of what the job's run wrote (its output's metadata, or the partial results of a
        stopped run), with the counts it gives. `held_event`: the job's end event, held until its output is
        final, released in the same transaction (`release_held_event`)."""
        values: dict[str, str | int] = {"results": results.to_column(), **results.row_counts()}
        with self.engine.begin() as connection:
            connection.execute(jobs.update().where(jobs.c.job_id == job_id, jobs.c.run_id == run_id).values(**values))
            if held_event is not None:
                release_held_event(connection, held_event)

    def record_kept(self, job_id: str, requests: int, prompt_tokens: int, completion_tokens: int) -> bool:
        """What a resumed job's checkpoints held when its resume's first run planned its shards: kept, never
        generated again. Counted once a resume: a retry of that run finds it set and keeps it."""
        unkept = sa.and_(jobs.c.job_id == job_id, jobs.c.resume_count.is_not(None), jobs.c.requests_kept.is_(None))
        kept = (
            jobs.update()
            .where(unkept)
            .values(requests_kept=requests, prompt_tokens_kept=prompt_tokens, completion_tokens_kept=completion_tokens)
        )
        with self.engine.begin() as connection:
            return connection.execute(kept).rowcount > 0

    def record_cached(self, job_id: str, requests: int, prompt_tokens: int, completion_tokens: int) -> None:
        """What the job's first plan answered from its team's result cache (a later run's plan looks
        nothing up, and keeps these)."""
        cached = (
            jobs.update()
            .where(jobs.c.job_id == job_id)
            .values(
                cached_requests=requests,
                cached_prompt_tokens=prompt_tokens,
                cached_completion_tokens=completion_tokens,
            )
        )
        with self.engine.begin() as connection:
            connection.execute(cached)
