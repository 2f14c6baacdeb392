"""Which waiting jobs take the free run slots, by fair share between teams.

A team's usage is its jobs' slot-seconds (a shard's run time times what its launcher gave its worker: the
cores a local worker ran on, a pod's GPU limit, or its CPU limit where it has none; a shard the launcher has
not said of, its request's GPUs or CPUs, at least one slot), over the time its runs ran, decayed with a
half-life, as Slurm's fair-share factor decays it: a second ago counts whole, one half-life ago half.
When slots are free, the next job comes from the team with the lowest usage per weight (then the fewest
running jobs per weight), below its `max_running_jobs` and, where it sets a `max_tokens_per_day`, below
that many tokens of the UTC day; within a team, the highest priority (capped at the team's `max_priority`)
first, then the oldest. Every free slot is filled while any team that may start
a job has one waiting, so a team alone uses them all.

Usage is fixed for one decision and each team's standing only rises as it is given slots, so the order
slots are given out in is the sorted order of every waiting job's standing (its team's usage per weight,
the team's running jobs per weight counting the ones given before it, its own age): `grant_slots` takes the
first `slots` of it from each team's best few jobs, and `queue_position` counts a job's place in it
without giving anything out. Both read the same `Queues` and the same `_standing`, so they cannot disagree.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple


class WaitingJob(NamedTuple):
    job_id: str
    owner: str
    priority: int  # the run priority as the team's cap reads it
    # When it was submitted; or its place in the order of submission (0 the first, equal for jobs submitted
    # at the same instant), as the job store reads the waiting jobs. One decision compares one kind.
    created_at: datetime | int


@dataclass(frozen=True)
class TeamShare:
    """What admission knows of a team (an owner of jobs): its weight and bound, its usage and its jobs
    holding run slots now; and, where it sets a `max_tokens_per_day`, its tokens of the UTC day so far."""

    weight: float = 1.0
    max_running_jobs: int | None = None
    usage: float = 0.0
    running: int = 0
    max_tokens_per_day: int | None = None
    tokens_today: int = 0

    def over_tokens(self) -> bool:
        """Its tokens of the day have reached its `max_tokens_per_day`: none of its jobs starts until 00:00 UTC."""
        return self.max_tokens_per_day is not None and self.tokens_today >= self.max_tokens_per_day

    def below_bound(self) -> int | None:
        """How many more of its jobs its `max_running_jobs` lets hold slots now (None: no bound)."""
        return None if self.max_running_jobs is None else max(0, self.max_running_jobs - self.running)

    def allowed(self) -> int | None:
        """How many more of its jobs may hold slots now (None: no bound): none while it is over its tokens
        of the day, else as its `max_running_jobs` allows."""
        return 0 if self.over_tokens() else self.below_bound()


@dataclass(frozen=True)
class SlotGrant:
    job: WaitingJob
    why: str  # for the sensor's log: the team's standing when it won the slot


_NO_SHARE = TeamShare()


class Queues:
    """The waiting jobs by team, each team's in the order it gives them out: highest priority, then oldest.

    Built in one pass over jobs already in age order (`ordered=True`: created_at, then job id, as the job
    store reads them), each job's id and age appended to its team's lists for its priority (no object made
    per job); a team's order is its priority lists, highest first, walked only as far as a decision needs."""

    def __init__(self, waiting: Iterable[WaitingJob] = (), ordered: bool = False) -> None:
        if not ordered:
            waiting = sorted(waiting, key=lambda job: (job.created_at, job.job_id))
        self.levels: dict[str, dict[int, tuple[list[str], list[datetime | int]]]] = {}
        for job in waiting:
            ids, ages = self.level(job.owner, job.priority)
            ids.append(job.job_id)
            ages.append(job.created_at)

    def level(self, owner: str, priority: int) -> tuple[list[str], list[datetime | int]]:
        """The ids and ages of the team's jobs of that priority, oldest first: append to both, in age order."""
        by_level = self.levels.get(owner)
        if by_level is None:
            by_level = self.levels[owner] = {}
        lists = by_level.get(priority)
        if lists is None:
            lists = by_level[priority] = ([], [])
        return lists

    def __len__(self) -> int:
        return sum(len(ids) for by_level in self.levels.values() for ids, _ in by_level.values())

    def owners(self) -> Iterable[str]:
        return self.levels.keys()

    def count(self, owner: str) -> int:
        return sum(len(ids) for ids, _ in self.levels.get(owner, {}).values())

    def in_order(self, owner: str) -> Iterator[WaitingJob]:
        """The team's jobs in the order it gives them out."""
        by_level = self.levels.get(owner, {})
        for level in sorted(by_level, reverse=True):
            ids, ages = by_level[level]
            for job_id, age in zip(ids, ages):
                yield WaitingJob(job_id, owner, level, age)

    def ordered_list(self, owner: str) -> list[WaitingJob]:
        return list(self.in_order(owner))


Standing = tuple[float, float, datetime | int, str]


def _standing(owner: str, share: TeamShare, given: int, next_job: WaitingJob) -> Standing:
    """A team's claim on the next slot, lowest first, when `given` of its jobs took slots this decision
    and `next_job` is its next: usage per weight, running jobs per weight, the next job's age, the name."""
    return (share.usage / share.weight, (share.running + given) / share.weight, next_job.created_at, owner)


def grant_slots(
    waiting: Iterable[WaitingJob] | Queues, teams: dict[str, TeamShare], slots: int | None
) -> list[SlotGrant]:
    """The jobs to start now, in order: at most `slots` (None: no limit), fairly shared out."""
    queues = waiting if isinstance(waiting, Queues) else Queues(waiting)
    heap: list[tuple[Standing, int, Iterator[WaitingJob], WaitingJob]] = []
    for owner in queues.owners():
        share = teams.get(owner, _NO_SHARE)
        if share.allowed() == 0:
            continue  # at its bound (its jobs wait for one of its own to end) or over its tokens of the day
        jobs = queues.in_order(owner)
        first = next(jobs, None)
        if first is not None:
            heap.append((_standing(owner, share, 0, first), 0, jobs, first))
    heapq.heapify(heap)
    granted: list[SlotGrant] = []
    while heap and (slots is None or len(granted) < slots):
        standing, given, jobs, job = heap[0]
        owner = standing[3]
        share = teams.get(owner, _NO_SHARE)
        granted.append(SlotGrant(job, _why(owner, share, given, job)))
        given += 1
        allowed = share.allowed()
        following = next(jobs, None) if allowed is None or given < allowed else None
        if following is None:
            heapq.heappop(heap)
        else:
            heapq.heapreplace(heap, (_standing(owner, share, given, following), given, jobs, following))
    return granted


def _why(owner: str, share: TeamShare, given: int, job: WaitingJob) -> str:
    return (
        f"the lowest standing of the teams waiting: {share.usage / share.weight:.0f} slot-seconds per weight "
        f"(weight {share.weight:g}), {share.running + given} running; its next job by priority ({job.priority}) "
        "then age"
    )


@dataclass(frozen=True)
class QueuePlace:
    """Where a waiting job stands in the order slots would be given out now."""

    position: int  # 1-based: among every team's waiting jobs, or its own team's only (`count_other_teams`)
    ahead_in_team: int  # of its own team's jobs
    held_by_bound: bool  # its team is at max_running_jobs: it comes after every job that may start now
    usage_per_weight: float  # its team's
    weight: float
    running: int
    # Its team's tokens of the UTC day have reached its max_tokens_per_day: it waits until 00:00 UTC, and
    # comes after every job that may start now, as a job held by its bound does.
    held_by_tokens: bool = False
    tokens_today: int = 0
    max_tokens_per_day: int | None = None


def queue_position(
    queues: Queues, teams: dict[str, TeamShare], job_id: str, owner: str, count_other_teams: bool = True
) -> QueuePlace | None:
    """The job's place in the order `grant_slots` gives out slots (with as many slots as jobs), without giving
    any: the count, team by team, of the standings lower than its own. A job its team's bound holds back,
    or every job of a team over its tokens of the day, comes after every job that may start now, in the
    same order (by standing) among the held ones. None: not waiting.

    Without `count_other_teams` (a team asking of its own job) its place among its own team's jobs only:
    how many jobs other teams have waiting, and how they stand, are theirs."""
    mine = queues.ordered_list(owner)
    rank = next((k for k, job in enumerate(mine) if job.job_id == job_id), None)
    if rank is None:
        return None
    share = teams.get(owner, _NO_SHARE)
    room = share.below_bound()
    held_by_bound = room is not None and rank >= room
    held = held_by_bound or share.over_tokens()
    target = _standing(owner, share, rank, mine[rank])
    ahead = rank
    for other in queues.owners() if count_other_teams else ():
        if other == owner:
            continue
        other_share = teams.get(other, _NO_SHARE)
        count = queues.count(other)
        bound = count if other_share.allowed() is None else min(count, other_share.allowed() or 0)
        # Its jobs at ranks [0, bound) may start now, the rest are held; a held job stands after every one
        # that may start.
        if held:
            before = bound + _lower(queues, other, other_share, target, bound, count)
        else:
            before = _lower(queues, other, other_share, target, 0, bound)
        ahead += before
    return QueuePlace(
        ahead + 1,
        rank,
        held_by_bound,
        share.usage / share.weight,
        share.weight,
        share.running,
        share.over_tokens(),
        share.tokens_today,
        share.max_tokens_per_day,
    )


def _lower(queues: Queues, owner: str, share: TeamShare, target: Standing, lo: int, hi: int) -> int:
    """How many of the team's jobs at ranks [lo, hi) stand below `target` (its standings rise with rank)."""
    if hi <= lo:
        return 0
    usage = share.usage / share.weight
    if usage != target[0]:
        return hi - lo if usage < target[0] else 0
    jobs = queues.ordered_list(owner)
    return bisect.bisect_left(range(lo, hi), target, key=lambda rank: _standing(owner, share, rank, jobs[rank]))


def decayed_slot_seconds(
    started_at: datetime, ended_at: datetime | None, units: float, now: datetime, half_life_s: float
) -> float:
    """`units` slots held from `started_at` to `ended_at` (or now), each second counted at
    2^-(its age / half-life): the integral, in closed form."""
    end = min(ended_at or now, now)
    if end <= started_at:
        return 0.0
    rate = math.log(2) / half_life_s
    age_at_end = (now - end).total_seconds()
    age_at_start = (now - started_at).total_seconds()
    return units * (math.exp(-rate * age_at_end) - math.exp(-rate * age_at_start)) / rate


def decay(value: float, since: datetime, now: datetime, half_life_s: float) -> float:
    """`value` slot-seconds as of `since`, as they count at `now`."""
    return value * 2.0 ** (-max(0.0, (now - since).total_seconds()) / half_life_s)


def shard_units(gpus: Any, cpus: Any) -> float:
    """What one shard of a job holds, the unit of its slot-seconds: its GPUs, else its CPUs (`500m` is half
    a CPU), else one slot. Values as a stored request has them, or as a database reads them from its JSON:
    numbers, or their text."""
    for value in (gpus, cpus):
        if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < math.inf:
            return float(value)
        if isinstance(value, str):
            try:
                number = float(value[:-1]) / 1000 if value.endswith("m") else float(value)
            except ValueError:
                continue
            if 0 < number < math.inf:  # rows of older releases may hold "1e400": not a share of anything
                return number
    return 1.0


def declared_units(gpus: Any, cpus: Any) -> float:
    """What a shard is charged where its launcher has not said what it gave it (a run of an older release,
    or before its worker starts): what its request asks (`shard_units`), never less than one slot, since no
    launcher gives a worker less than a core. A declared fraction does not lower a charge."""
    return max(1.0, shard_units(gpus, cpus))
