"""The result cache's routes' service: a team reads and empties its own cache; an admin names a team."""

from __future__ import annotations

import contextlib

from batch_pipeline.api.auth import Caller
from batch_pipeline.api.usage import ForbiddenTeam
from batch_pipeline.contract.result_cache import ResultCacheEmptied, ResultCacheFigures
from batch_pipeline.core import io
from batch_pipeline.store.result_cache import ResultCacheStore
from batch_pipeline.tenancy.tenants import TEAM_OWNER_PREFIX, Tenants, owner_team


class UnknownTeam(LookupError):
    pass


def cache_owner(caller: Caller, registry: Tenants | None, team: str | None) -> str:
    """Whose cache a request reads: the caller's own, or for an admin key the team it names."""
    if team is None:
        return caller.owner
    if not caller.is_admin:
        if owner_team(caller.owner) == team:
            return caller.owner
        raise ForbiddenTeam("a team's key reads and empties its own team's result cache only")
    if registry is None or team not in registry.teams:
        raise UnknownTeam(f"no team {team!r} in the tenants file")
    return TEAM_OWNER_PREFIX + team


def cache_figures(store: ResultCacheStore, owner: str) -> ResultCacheFigures:
    figures = store.figures(owner)
    return ResultCacheFigures(team=owner_team(owner), entries=figures.entries, stored_bytes=figures.payload_bytes)


def empty_cache(store: ResultCacheStore, owner: str) -> ResultCacheEmptied:
    """Every entry of `owner`'s cache removed, then the payload files no entry points at."""
    before = store.figures(owner)
    for path in store.drop(owner):
        with contextlib.suppress(OSError):  # a file left behind is found by no lookup
            io.remove(path)
    return ResultCacheEmptied(team=owner_team(owner), deleted_entries=before.entries, freed_bytes=before.payload_bytes)
