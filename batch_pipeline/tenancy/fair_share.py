"""Which waiting jobs take the free run slots, by fair share between teams.

A team's usage is its jobs' slot-seconds (a shard's run time times its GPUs, or its CPUs where it asks
for none), decayed with a half-life, as Slurm's fair-share factor decays it: a second ago counts whole,
one half-life ago half. When slots are free, the next job comes from the team with the lowest usage per
weight (then the fewest running jobs per weight), below its `max_running_jobs`; within a team, the
highest priority (capped at the team's `max_priority`) first, then the oldest. Every free slot is filled
while any team has a job waiting, so a team alone uses them all.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class WaitingJob:
    job_id: str
    owner: str
    priority: int  # the run priority as the team's cap reads it
    created_at: datetime


@dataclass(frozen=True)
class TeamShare:
    """What admission knows of a team (an owner of jobs): its weight and bound, its usage and its jobs
    holding run slots now."""

    weight: float = 1.0
    max_running_jobs: int | None = None
    usage: float = 0.0
    running: int = 0


@dataclass(frozen=True)
class Admission:
    job: WaitingJob
    why: str  # for the sensor's log: the team's standing when it won the slot


def admit(waiting: Iterable[WaitingJob], teams: dict[str, TeamShare], slots: int | None) -> list[Admission]:
    """The jobs to start now, in order: at most `slots` (None: no limit), fairly shared out."""
    queues: dict[str, list[WaitingJob]] = {}
    for job in waiting:
        queues.setdefault(job.owner, []).append(job)
    for jobs in queues.values():
        jobs.sort(key=lambda job: (-job.priority, job.created_at, job.job_id), reverse=True)  # next job last
    running = {owner: teams.get(owner, TeamShare()).running for owner in queues}

    def standing(owner: str) -> tuple[float, float, datetime]:
        share = teams.get(owner, TeamShare())
        return (share.usage / share.weight, running[owner] / share.weight, queues[owner][-1].created_at)

    heap = [(standing(owner), owner) for owner in queues]
    heapq.heapify(heap)
    admitted: list[Admission] = []
    while heap and (slots is None or len(admitted) < slots):
        (usage_per_weight, _, _), owner = heapq.heappop(heap)
        share = teams.get(owner, TeamShare())
        if share.max_running_jobs is not None and running[owner] >= share.max_running_jobs:
            continue  # at its bound: its jobs wait for one of its own to end
        job = queues[owner].pop()
        admitted.append(
            Admission(
                job,
                f"{owner}: {usage_per_weight:.0f} slot-seconds per weight (weight {share.weight:g}), "
                f"{running[owner]} running, priority {job.priority}",
            )
        )
        running[owner] += 1
        if queues[owner]:
            heapq.heappush(heap, (standing(owner), owner))
    return admitted


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
