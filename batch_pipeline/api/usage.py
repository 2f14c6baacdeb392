"""`GET /v2/usage`: each team's usage per UTC day, from a few grouped queries of the job store (no file,
no run, no event log is read).

A job's work (requests done, prompt and completion tokens, gpu_seconds) counts on the UTC day it ended,
whole, or today while it runs, so the days' figures of a job sum to its own metadata, and a team's
tokens of a day are what its `max_tokens_per_day` counts. gpu_seconds is fair share's measure, undecayed:
the seconds the job's runs ran (each from its start to its end, or now: not the time it sat stopped before
a resume), times what each of its shards was given (the cores a local worker ran on, a pod's GPU limit,
else its CPU limit; where the launcher has not said, the shard's GPUs, else its CPUs, at least one). Jobs
count on the day they were submitted; stored bytes on the day they were stored (OpenAI files still kept:
uploads and batches' output and error files), a job's inline content and checkpoints on the day it was
submitted, until retention deletes its work dir.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import TypedDict

from batch_pipeline.api.auth import Caller
from batch_pipeline.contract.usage import TeamUsage, UsageDay, UsageResponse
from batch_pipeline.store.openai import OpenAIStore
from batch_pipeline.store.reports import ReportStore
from batch_pipeline.store.result_cache import ResultCacheStore
from batch_pipeline.tenancy.fair_share import declared_units
from batch_pipeline.tenancy.tenants import ADMINS_OWNER, TEAM_OWNER_PREFIX, Tenants

OTHER = "other"  # the one label of every owner the tenants file does not name
DEFAULT_DAYS = 30
MAX_DAYS = 366
FIRST_YEAR, LAST_YEAR = 1970, 9998
_DATE = re.compile(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$")


class InvalidUsageQuery(ValueError):
    """A query parameter the route refuses with 422: `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class ForbiddenTeam(PermissionError):
    """A team's key asking for another team's usage or jobs."""


def named_owners(registry: Tenants | None) -> list[str]:
    """The owners reported by name: the tenants file's teams and the admins; every other one is `other`."""
    return [*(team.owner for team in registry.teams.values()), ADMINS_OWNER] if registry else [ADMINS_OWNER]


def team_label(owner: str | None) -> str:
    """The team name of an owner `named_owners` holds (`admins` for admins), `other` for None."""
    if owner is None:
        return OTHER
    return owner.removeprefix(TEAM_OWNER_PREFIX)


def label_of_owner(owner: str, named: list[str]) -> str:
    return team_label(owner if owner in named else None)


def usage_range(since: str | None, until: str | None, now: datetime) -> tuple[datetime, datetime]:
    """[start, end) of the range asked for: a date means its whole UTC day (since from its start, until to
    its end), a datetime (RFC 3339; UTC when it names no offset) the instant. Default: until now, since
    the start of the UTC day 29 days before until's, so 30 days. At most MAX_DAYS days."""
    end = _instant(until, "until", end_of_day=True) if until is not None else now
    if since is not None:
        start = _instant(since, "since", end_of_day=False)
    else:
        last_day = (end - timedelta(microseconds=1)).date()
        start = datetime.combine(last_day - timedelta(days=DEFAULT_DAYS - 1), time(), UTC)
    if end <= start:
        raise InvalidUsageQuery("until", f"must be after since ({start.isoformat()})")
    if end - start > timedelta(days=MAX_DAYS):
        raise InvalidUsageQuery("since", f"the range from since to until may span at most {MAX_DAYS} days")
    return start, end


def _instant(value: str, name: str, end_of_day: bool) -> datetime:
    text = value.strip()
    try:
        if _DATE.match(text):
            day = date.fromisoformat(text)
            moment = datetime.combine(day, time(), UTC)
            if FIRST_YEAR <= day.year <= LAST_YEAR:
                return moment + timedelta(days=1) if end_of_day else moment
            raise OverflowError(text)
        if len(text) > 40 or not re.match(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ]", text):
            raise ValueError(text)
        moment = datetime.fromisoformat(text)
        moment = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    except (ValueError, OverflowError):
        raise InvalidUsageQuery(
            name, f"expected a date (YYYY-MM-DD) or an RFC 3339 datetime, got {value[:64]!a}"
        ) from None
    if not FIRST_YEAR <= moment.year <= LAST_YEAR:  # so that a day more or a month less stays a date
        raise InvalidUsageQuery(name, f"must lie in the years {FIRST_YEAR} to {LAST_YEAR}, got {value[:64]!a}")
    return moment


class UsageFigures(TypedDict):
    """The figures a day's or a team's usage line reports (`UsageDay`, `TeamUsage`)."""

    jobs: int
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_requests: int
    cached_completion_tokens: int
    gpu_seconds: float
    stored_bytes: int


@dataclass
class _Figures:
    jobs: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_requests: int = 0
    cached_completion_tokens: int = 0
    gpu_seconds: float = 0.0
    stored_bytes: int = 0

    def figures(self) -> UsageFigures:
        return {
            "jobs": self.jobs,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_requests": self.cached_requests,
            "cached_completion_tokens": self.cached_completion_tokens,
            "gpu_seconds": round(self.gpu_seconds, 3),
            "stored_bytes": self.stored_bytes,
        }


def usage_report(
    store: ReportStore,
    registry: Tenants | None,
    caller: Caller,
    since: str | None = None,
    until: str | None = None,
    team: str | None = None,
    now: datetime | None = None,
) -> UsageResponse:
    """The caller's team's usage per UTC day (every team's for an admin, or `team`'s alone), raising
    InvalidUsageQuery for a bad range and ForbiddenTeam for a team's key naming another team."""
    now = (now or datetime.now(UTC)).astimezone(UTC)
    start, end = usage_range(since, until, now)
    named = named_owners(registry)
    own = label_of_owner(caller.owner, named)
    if not caller.is_admin and team is not None and team != own:
        raise ForbiddenTeam("a team's key reads its own team's usage only; an admin key reads every team's")
    owner = None if caller.is_admin else caller.owner  # a team's figures are read for its owner alone
    wanted = team if caller.is_admin else own
    files = OpenAIStore(engine=store.engine)

    days: dict[tuple[str, str], _Figures] = {}

    def day(bucket: str | None, on: str) -> _Figures:
        return days.setdefault((team_label(bucket), on), _Figures())

    for work in store.work_by_day(start, end, now, owner, named):
        figures = day(work.owner, work.day)
        figures.requests += work.requests_done
        figures.prompt_tokens += work.prompt_tokens
        figures.completion_tokens += work.completion_tokens
        figures.cached_requests += work.cached_requests
        figures.cached_completion_tokens += work.cached_completion_tokens
        figures.gpu_seconds += work.charged_seconds + work.shard_seconds * declared_units(work.gpus, work.cpus)
    for bucket, on, jobs, work_dir_bytes in store.submissions_by_day(start, end, owner, named):
        figures = day(bucket, on)
        figures.jobs += jobs
        figures.stored_bytes += work_dir_bytes
    for bucket, on, file_bytes in files.file_bytes_by_day(start, end, owner, named):
        day(bucket, on).stored_bytes += file_bytes
    stored_now: dict[str, int] = {}
    cached = ResultCacheStore(engine=store.engine).payload_bytes_by_owner(owner, named)
    for totals in (files.file_bytes_by_owner(owner, named), store.work_dir_bytes_by_owner(owner, named), cached):
        for bucket, stored in totals.items():
            stored_now[team_label(bucket)] = stored_now.get(team_label(bucket), 0) + stored

    teams: dict[str, _Figures] = {}
    listed = [own] if not caller.is_admin else [team_label(owner) for owner in named]
    for label in _labels(listed, (label for label, _ in days), stored_now):
        teams[label] = _Figures()
    for (label, _), figures in days.items():
        total = teams[label]
        total.jobs += figures.jobs
        total.requests += figures.requests
        total.prompt_tokens += figures.prompt_tokens
        total.completion_tokens += figures.completion_tokens
        total.cached_requests += figures.cached_requests
        total.cached_completion_tokens += figures.cached_completion_tokens
        total.gpu_seconds += figures.gpu_seconds
        total.stored_bytes += figures.stored_bytes
    return UsageResponse(
        since=start.isoformat().replace("+00:00", "Z"),
        until=end.isoformat().replace("+00:00", "Z"),
        days=[
            UsageDay(team=label, day=on, **figures.figures())
            for (label, on), figures in sorted(days.items(), key=lambda item: (item[0][1], item[0][0]))
            if wanted is None or label == wanted
        ],
        teams=[
            TeamUsage(team=label, **figures.figures(), stored_bytes_now=stored_now.get(label, 0))
            for label, figures in sorted(teams.items())
            if wanted is None or label == wanted
        ],
    )


def _labels(listed: list[str], seen: Iterable[str], stored: dict[str, int]) -> list[str]:
    return list(dict.fromkeys([*listed, *seen, *stored]))
