"""Run slots given out by fair share, where a tenants file names the teams: a job waits in the job store until a run
slot can take it, and the jobs sensor asks for runs only for the jobs `fair_share.grant_slots` picks, so that
Dagster's run queue never holds a deep backlog in the order jobs arrived.

Run slots are the instance's `max_concurrent_runs` (QueuedRunCoordinator) less the runs in progress, of
any job. A team whose tokens of the UTC day (`QuotaStore.tokens_since`, as submission counts them) have
reached its `max_tokens_per_day` is held as a team at its `max_running_jobs` is: none of its waiting jobs
is admitted until 00:00 UTC, and the other teams' jobs take the slots. Without a tenants file there are
no teams to share between: every job gets its run at once and waits in Dagster's queue by priority, as
before.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import dagster as dg
from dagster._core.run_coordinator import QueuedRunCoordinator
from dagster._core.storage.dagster_run import IN_PROGRESS_RUN_STATUSES

from batch_pipeline.contract.priority import InvalidPriority, run_priority
from batch_pipeline.pipeline.tags import SCHEDULE_OWNER_PREFIX
from batch_pipeline.store.records import JobRecord
from batch_pipeline.store.sharing import SharingStore, SlotUse
from batch_pipeline.tenancy.fair_share import (
    QueuePlace,
    Queues,
    SlotGrant,
    TeamShare,
    decay,
    decayed_slot_seconds,
    declared_units,
    grant_slots,
    queue_position,
)
from batch_pipeline.tenancy.tenants import Tenants

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


class SlotGrants(list[SlotGrant]):
    """The waiting jobs to give runs now, in order; and `held`: each team with jobs waiting that its
    `max_tokens_per_day` holds now, with why (`{owner}'s {why}` reads as a sentence), for the sensor's log:
    one line a team, not one a job."""

    def __init__(self, admitted: list[SlotGrant], held: dict[str, str]) -> None:
        super().__init__(admitted)
        self.held = held


def utc_midnight(now: datetime) -> datetime:
    """The start of `now`'s UTC day, from which a team's tokens of the day count."""
    return now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)


def team_shares(
    store: SharingStore, registry: Tenants, now: datetime, half_life_s: float, count: bool = False
) -> dict[str, TeamShare]:
    """Each owner's weight, bound, decayed usage and slots held now (owners no team names: weight 1); and
    each team's tokens of the UTC day where it sets a `max_tokens_per_day` (one grouped read of those
    teams, none where no team sets one).

    A team's usage is its row of ended jobs (decayed from when it was written), the jobs that ended since
    (not yet counted) and its running jobs up to now. With `count` (the jobs sensor, once a tick), the
    ended ones are written into the rows, so that the next tick reads them no more."""
    since = now - timedelta(seconds=half_life_s * _HALF_LIVES_READ)
    usage = {owner: decay(value, as_of, now, half_life_s) for owner, (value, as_of) in store.team_usage().items()}
    changed: set[str] = set()
    ended = store.slot_usage_uncounted(since)
    for use in ended:
        usage[use.owner] = usage.get(use.owner, 0.0) + _slot_seconds(use, use.ended_at, now, half_life_s)
        changed.add(use.owner)
    running = store.slot_usage_running()
    again = [use for use in running if use.counted_until is not None]
    for use in again:  # running again after its end was counted: counted from its runs' start while it runs
        taken = _counted_slot_seconds(use, now, half_life_s)
        usage[use.owner] = max(0.0, usage.get(use.owner, 0.0) - taken)
        changed.add(use.owner)
    if count:
        store.count_slot_usage(
            {owner: (usage[owner], now) for owner in changed},
            [use.job_id for use in ended],
            [use.job_id for use in again],
            since,
        )
    for use in running:
        usage[use.owner] = usage.get(use.owner, 0.0) + _slot_seconds(use, None, now, half_life_s)
    holders = store.slot_holders()
    limits = {
        team.owner: team.config.max_tokens_per_day
        for team in registry.teams.values()
        if team.config.max_tokens_per_day is not None
    }
    tokens = store.tokens_since_by_owner(limits, utc_midnight(now)) if limits else {}
    shares = {}
    for owner in set(usage) | set(holders):
        team = registry.team_of_owner(owner)
        shares[owner] = TeamShare(
            weight=team.config.weight if team else 1.0,
            max_running_jobs=team.config.max_running_jobs if team else None,
            usage=usage.get(owner, 0.0),
            running=holders.get(owner, 0),
            max_tokens_per_day=limits.get(owner),
            tokens_today=tokens.get(owner, 0),
        )
    for team in registry.teams.values():  # a team's bounds hold before it has used anything
        shares.setdefault(
            team.owner,
            TeamShare(
                team.config.weight,
                team.config.max_running_jobs,
                max_tokens_per_day=team.config.max_tokens_per_day,
                tokens_today=tokens.get(team.owner, 0),
            ),
        )
    return shares


def _slot_seconds(use: SlotUse, end: datetime | None, now: datetime, half_life_s: float) -> float:
    return decayed_slot_seconds(use.started_at, end, _units(use), now, half_life_s)


def _counted_slot_seconds(use: SlotUse, now: datetime, half_life_s: float) -> float:
    """What its team's usage row counted of a job when its end was counted: its runs until then, which are
    its earlier runs now that another has started (`mark_started` added the one that ended)."""
    assert use.counted_until is not None
    start = use.counted_until - timedelta(seconds=use.earlier_runs_s)
    return decayed_slot_seconds(start, use.counted_until, _units(use), now, half_life_s)


def _units(use: SlotUse) -> float:
    """What the job's shards hold: what the launcher gave each it said of, its request's size for the rest
    (one shard before any is planned)."""
    unsized = max(use.shards - use.charged_shards, 0) if use.shards else 1
    return use.charged_units + unsized * _units_per_shard(use)


def _units_per_shard(use: SlotUse) -> float:
    """What one shard of the job holds where its launcher has not said (fair_share.declared_units of its
    request's gpus and cpus)."""
    try:
        request = json.loads(use.request_json)
    except ValueError:
        return 1.0
    return declared_units(request.get("gpus"), request.get("cpus")) if isinstance(request, dict) else 1.0


def waiting_queues(store: SharingStore, registry: Tenants, skip_owners: str | None = None) -> Queues:
    """The queued jobs without a run, by team in the order each gives them out: one read of the waiting
    jobs' index (id, owner, priority, age; no request), each priority read as its team's cap reads it
    once per team and stored priority. A job's `created_at` here is its place in the order of submission
    (equal for jobs created at the same instant), which is all `Queues` compares. Owners starting with
    `skip_owners` are left out."""
    queues = Queues()
    targets: dict[str, dict[str | None, tuple[list[str], list[datetime | int]]]] = {}
    skipped: dict[str | None, tuple[list[str], list[datetime | int]]] = {}
    age, last = -1, None
    for job_id, owner, priority, created in store.waiting_for_admission():
        if created != last:
            age, last = age + 1, created
        by_priority = targets.get(owner)
        if by_priority is None:
            by_priority = targets[owner] = skipped if skip_owners and owner.startswith(skip_owners) else {}
        target = by_priority.get(priority)
        if target is None:
            if by_priority is skipped:
                continue
            target = by_priority[priority] = queues.level(owner, _capped_priority(registry, owner, priority))
        target[0].append(job_id)
        target[1].append(age)
    return queues


def slot_grants(
    queues: Queues,
    store: SharingStore,
    registry: Tenants,
    slots: int | None,
    now: datetime,
    half_life_s: float,
    count: bool = True,
) -> SlotGrants:
    """The waiting jobs to give runs now, in order, each with why it won its slot; and the teams their
    tokens of the day hold (`SlotGrants.held`)."""
    shares = team_shares(store, registry, now, half_life_s, count=count)
    held = {
        owner: tokens_hold(share, queues.count(owner))
        for owner in queues.owners()
        if (share := shares.get(owner)) is not None and share.over_tokens()
    }
    return SlotGrants(grant_slots(queues, shares, slots), held)


def tokens_hold(share: TeamShare, waiting: int) -> str:
    """Why a team's `waiting` jobs wait however free the slots are: its tokens of the day."""
    jobs = f"{waiting} waiting job is" if waiting == 1 else f"{waiting} waiting jobs are"
    return (
        f"{jobs} held by its max_tokens_per_day: it has used {share.tokens_today}/{share.max_tokens_per_day} "
        f"tokens today (UTC); {'it waits' if waiting == 1 else 'they wait'} until 00:00 UTC"
    )


def place_in_queue(
    store: SharingStore,
    registry: Tenants,
    record: JobRecord,
    now: datetime,
    half_life_s: float,
    count_other_teams: bool = True,
) -> QueuePlace | None:
    """Where a waiting job stands now in the order the jobs sensor gives out run slots, by the same reads
    and the same order (`fair_share.queue_position` over what `grant_slots` reads); nothing is written. Without
    `count_other_teams`, among its own team's jobs only (what a team may be told)."""
    queues = waiting_queues(store, registry, skip_owners=SCHEDULE_OWNER_PREFIX)
    shares = team_shares(store, registry, now, half_life_s)
    return queue_position(queues, shares, record.job_id, record.owner, count_other_teams)


def _capped_priority(registry: Tenants, owner: str, priority: str | None) -> int:
    team = registry.team_of_owner(owner)
    try:
        return run_priority(priority, team.config.priority_cap if team is not None else None)
    except InvalidPriority:  # a row an older release stored; its run request will say what is wrong
        return 0
