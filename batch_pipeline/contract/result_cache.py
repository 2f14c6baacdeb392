"""The result cache's routes (issue 49): what a team's cache holds, and emptying it."""

from __future__ import annotations

from pydantic import Field

from batch_pipeline.contract.base import WireModel


class ResultCacheFigures(WireModel):
    team: str | None = Field(description="The team whose cache this is (null: a key of no team's)")
    entries: int = Field(description="Deterministic results kept, each answering the team's later identical requests")
    stored_bytes: int = Field(description="Their outputs' bytes: counted in the team's max_stored_bytes")


class ResultCacheEmptied(WireModel):
    team: str | None = Field(description="The team whose cache was emptied")
    deleted_entries: int = Field(description="Results removed: the team's later jobs generate them again")
    freed_bytes: int = Field(description="Bytes no longer counted in the team's max_stored_bytes")
