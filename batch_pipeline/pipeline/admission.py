"""Admission by fair share, where a tenants file names the teams: a job waits in the job store until a run
slot can take it, and the jobs sensor asks for runs only for the jobs `fair_share.admit` picks, so that
Dagster's run queue never holds a deep backlog in the order jobs arrived.

Run slots are the instance's `max_concurrent_runs` (QueuedRunCoordinator) less the runs in progress, of
any job. Without a tenants file there are no teams to share between: every job gets its run at once and
waits in Dagster's queue by priority, as before.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime, timedelta

import dagster as dg
from dagster._core.run_coordinator import QueuedRunCoordinator
from dagster._core.storage.dagster_run import IN_PROGRESS_RUN_STATUSES

from batch_pipeline.contract.priority import InvalidPriority, run_priority
from batch_pipeline.core.settings import settings
from batch_pipeline.store.jobs import JobRecord, JobStore, SlotUse
from batch_pipeline.tenancy.fair_share import Admission, TeamShare, WaitingJob, admit, decayed_slot_seconds
from batch_pipeline.tenancy.tenants import Tenants, priority_cap

# Usage older than this many half-lives counts for less than 0.1 %: it is not read at all.
_HALF_LIVES_READ = 10


def free_run_slots(instance: dg.DagsterInstance) -> int | None:
    """How many more runs the instance would start now; None where it starts every run at once."""
    coordinator = instance.run_coordinator
    if not isinstance(coordinator, QueuedRunCoordinator):
        return None
    limit = coordinator.get_run_queue_config().max_concurrent_runs
    if limit < 0:
        return None
    in_progress = instance.get_runs_count(filters=dg.RunsFilter(statuses=IN_PROGRESS_RUN_STATUSES))
    return max(0, limit - in_progress)


def team_shares(store: JobStore, registry: Tenants, now: datetime) -> dict[str, TeamShare]:
    """Each owner's weight, bound, decayed usage and slots held now (owners no team names: weight 1)."""
    half_life_s = settings().fair_share_half_life_s
    usage: dict[str, float] = {}
    for use in store.slot_usage_since(now - timedelta(seconds=half_life_s * _HALF_LIVES_READ)):
        units = max(use.shards, 1) * _units_per_shard(use)
        usage[use.owner] = usage.get(use.owner, 0.0) + decayed_slot_seconds(
            use.started_at, use.ended_at, units, now, half_life_s
        )
    holders = store.slot_holders()
    shares = {}
    for owner in set(usage) | set(holders):
        team = registry.team_of_owner(owner)
        shares[owner] = TeamShare(
            weight=team.config.weight if team else 1.0,
            max_running_jobs=team.config.max_running_jobs if team else None,
            usage=usage.get(owner, 0.0),
            running=holders.get(owner, 0),
        )
    for team in registry.teams.values():  # a team's bound holds before it has used anything
        shares.setdefault(team.owner, TeamShare(team.config.weight, team.config.max_running_jobs))
    return shares


def _units_per_shard(use: SlotUse) -> float:
    """What one shard of the job holds: its GPUs, else its CPUs, else one slot."""
    try:
        request = json.loads(use.request_json)
    except ValueError:
        return 1.0
    for field in ("gpus", "cpus"):
        value = request.get(field)
        if isinstance(value, int | float) and value > 0:
            return float(value)
        if isinstance(value, str):
            try:
                number = float(value[:-1]) / 1000 if value.endswith("m") else float(value)
            except ValueError:
                continue
            if number > 0:
                return number
    return 1.0


def admissions(
    records: Iterable[JobRecord], store: JobStore, registry: Tenants, slots: int | None, now: datetime
) -> list[tuple[JobRecord, Admission]]:
    """The waiting jobs to give runs now, in order, each with why it won its slot."""
    by_id = {record.job_id: record for record in records}
    waiting = [
        WaitingJob(record.job_id, record.owner, _capped_priority(record), record.created_at)
        for record in by_id.values()
    ]
    return [(by_id[chosen.job.job_id], chosen) for chosen in admit(waiting, team_shares(store, registry, now), slots)]


def _capped_priority(record: JobRecord) -> int:
    try:
        return run_priority(record.priority, priority_cap(record.owner))
    except InvalidPriority:  # a row an older release stored; its run request will say what is wrong
        return 0
