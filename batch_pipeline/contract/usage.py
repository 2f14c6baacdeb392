"""`GET /v2/usage`: what each team used, per UTC day, and what it stores now."""

from __future__ import annotations

from pydantic import Field

from batch_pipeline.contract.base import WireModel

_TEAM = (
    "The team of the tenants file; `admins` for admin keys' jobs; `other` for every other owner's (jobs of keys "
    "from before the tenants file, or of teams it no longer names)"
)


class UsageDay(WireModel):
    team: str = Field(description=_TEAM)
    day: str = Field(description="The UTC day, YYYY-MM-DD")
    jobs: int = Field(description="Jobs submitted that day")
    requests: int = Field(
        description="Requests done (results and error entries) of the jobs that ended that day, or that run now "
        "(today): the jobs' own requests_done"
    )
    prompt_tokens: int = Field(description="Prompt tokens of those jobs: their metadata's prompt_tokens")
    completion_tokens: int = Field(
        description="Completion tokens of those jobs: their metadata's completion_tokens_generated"
    )
    cached_requests: int = Field(
        0, description="Of requests: answered from the team's result cache, computed by an earlier job (issue 49)"
    )
    cached_completion_tokens: int = Field(
        0, description="Of completion_tokens: those of the requests answered from the result cache, not generated"
    )
    gpu_seconds: float = Field(
        description="What those jobs held, as fair share counts it: the seconds each job's runs ran (each from "
        "its start to its end, or now; not the time it sat stopped before a resume), times what each of its "
        "shards' workers was given (a local worker's cores, a pod's GPU, else CPU, limit; a shard not yet "
        "charged: its GPUs, else its CPUs, at least one)"
    )
    stored_bytes: int = Field(
        description="Bytes the team stored that day and still stores: OpenAI files (uploads, its batches' output "
        "and error files) not expired, and the inline content and checkpoints of the jobs it submitted whose work "
        "dirs retention has not deleted"
    )


class TeamUsage(WireModel):
    team: str = Field(description=_TEAM)
    jobs: int
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_requests: int = 0
    cached_completion_tokens: int = 0
    gpu_seconds: float
    stored_bytes: int = Field(description="The days' stored_bytes, summed")
    stored_bytes_now: int = Field(
        description="What the team stores now, whenever stored: what its max_stored_bytes counts"
    )


class UsageResponse(WireModel):
    since: str = Field(description="The range's start (RFC 3339, UTC), included")
    until: str = Field(description="The range's end (RFC 3339, UTC), excluded")
    days: list[UsageDay] = Field(description="Per team and UTC day with any figure, by day then team")
    teams: list[TeamUsage] = Field(description="Per team: the range's figures summed, and its stored bytes now")
