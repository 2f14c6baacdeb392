"""A job's figures as its run wrote them: `JobResults`, the one shape of the job row's `results` column, which
the pipeline writes (a finished run's counts, tokens and timings; a stopped run's partial results) and the API
and the dry run read.

The column holds the model as JSON, each figure not known left out; a row an older release wrote still reads:
keys it no longer knows are ignored, and figures it did not write read None.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict


class JobResults(BaseModel):
    """The summary of what a job's run wrote: its output's metadata (a run that finished), or the partial
    results a stopped run kept (`keep_partial_results`). The fields are in the order the column's JSON has
    always listed them."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    # A stopped run's: the job, the run, the error code and the message of each unfinished request's entry.
    job_id: str | None = None
    dagster_run_id: str | None = None
    status: str | None = None
    num_requests: int | None = None
    num_errors: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    completion_tokens_per_s: float | None = None  # per shard worker while generating (`JobMetadata`'s)
    wall_s: float | None = None
    merge_s: float | None = None
    num_finished: int | None = None  # a stopped run's results kept, and those it left error entries
    num_unfinished: int | None = None
    reason: str | None = None
    # A finished run's counts as the job's row keeps them: it did every request it planned.
    requests_total: int | None = None
    requests_done: int | None = None
    errors: int | None = None
    # Of a run of this release on (issue 46): without them, completion_tokens_per_s is over wall_s.
    completion_tokens_per_wall_s: float | None = None
    engine_start_s: float | None = None
    # Of a run of this release on (issue 48): per shard worker while it ran, as completion_tokens_per_s.
    prompt_tokens_per_s: float | None = None

    @classmethod
    def from_column(cls, text: str) -> JobResults:
        """The figures as the `results` column holds them (read with `json`, so each number is the one the
        column spells, as it always was)."""
        return cls.model_validate(json.loads(text))

    def to_column(self) -> str:
        """The column's JSON: the figures known, as `json.dumps` has always written them."""
        return json.dumps(self.model_dump(exclude_none=True))

    def kept_of(self, run_id: str | None) -> bool:
        """Whether these are what keep_partial_results kept of the stopped run `run_id`: the output it
        wrote whole, its last file written."""
        return run_id is not None and self.dagster_run_id == run_id and self.num_finished is not None

    def row_counts(self) -> dict[str, int]:
        """The figures known of those the job's row also keeps in columns of their own (progress, usage and
        /metrics read those), by column."""
        counts = {
            "requests_total": self.requests_total,
            "requests_done": self.requests_done,
            "errors": self.errors,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }
        return {column: count for column, count in counts.items() if count is not None}


@dataclass(frozen=True)
class CompletedFigures:
    """A completed job's figures, with the shard workers it ran in: the history a dry run's time is
    estimated from (`ReportStore.completed_figures`)."""

    results: JobResults
    shards: int
