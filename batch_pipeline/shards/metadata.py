"""The job's metadata file, `<output_data_path>.metadata.json`: what its users read beside the output (counts,
tokens, timings, how the job was split, each shard's stats), one model that the pipeline writes when a run
completes and `keep_partial_results` when a stopped run keeps its finished results; and a resumed job's
figures (what its checkpoints kept, what was generated since), computed here for the file and the API alike.
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from datetime import datetime
from typing import IO, Any, Protocol

from pydantic import BaseModel, ConfigDict, field_serializer, model_serializer, model_validator

from batch_pipeline.shards.protocol import ShardStats


class DataParallelism(BaseModel):
    """The shards a job ran in against the `data_parallelism` it asked for, and why fewer (None: as asked)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    requested: int
    used: int
    reason: str | None


class ShardEntry(BaseModel):
    """One shard's entry: the stats its worker reported and, where its launcher sized a pod, what the pod was
    sized to and what of that was inferred. The file spells it flat: the stats' fields, then the pod's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stats: ShardStats
    pod_hardware: dict[str, str | int | float] | None = None  # the hardware fields the launcher sized the pod to
    pod_hardware_inferred: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_flat(cls, raw: Any) -> Any:
        if not isinstance(raw, dict) or "stats" in raw:
            return raw
        pod = {key: raw[key] for key in ("pod_hardware", "pod_hardware_inferred") if key in raw}
        return {"stats": {key: value for key, value in raw.items() if key not in pod}, **pod}

    @model_serializer(mode="plain")
    def _flat(self) -> dict[str, object]:
        entry = self.stats.to_dict()
        if self.pod_hardware is not None:
            entry |= {"pod_hardware": self.pod_hardware, "pod_hardware_inferred": self.pod_hardware_inferred}
        return entry


class ResumeFigures(BaseModel):
    """A resumed job's requests and completion tokens: those its checkpoints kept when the resume's run planned
    its shards, and those generated since (its tokens only once they are all counted: the run completed)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    resume_requests_kept: int
    resume_requests_generated: int
    resume_completion_tokens_kept: int
    resume_completion_tokens_generated: int | None = None


class ResumedJob(Protocol):
    """What the job store knows of a job's resume (its `JobRecord`)."""

    @property
    def resume_count(self) -> int | None: ...
    @property
    def resumed_from(self) -> str | None: ...
    @property
    def resumed_from_run_id(self) -> str | None: ...
    @property
    def requests_kept(self) -> int | None: ...
    @property
    def completion_tokens_kept(self) -> int | None: ...


def resume_figures(job: ResumedJob, requests_done: int, completion_tokens: int | None) -> ResumeFigures | None:
    """What `job` kept and generated of its `requests_done` requests and `completion_tokens` (None: not all
    counted yet); None for a job never resumed, or whose resume's run has not counted its checkpoints yet.
    Nothing reads as generated below 0: a running job's progress counts its shards' reports so far, which may
    not hold every kept result yet."""
    if not job.resume_count or job.requests_kept is None:
        return None
    tokens_kept = job.completion_tokens_kept or 0
    return ResumeFigures(
        resume_requests_kept=job.requests_kept,
        resume_requests_generated=max(0, requests_done - job.requests_kept),
        resume_completion_tokens_kept=tokens_kept,
        resume_completion_tokens_generated=(
            None if completion_tokens is None else max(0, completion_tokens - tokens_kept)
        ),
    )


class JobMetadata(BaseModel):
    """The metadata file. It holds the fields its writer set, in this order, a figure not known as null; the
    fields not set are left out: a stopped run's file (`keep_partial_results`) has its own few, and only a
    resumed job's has the resume's. A file read back (`from_json`) writes the same (`to_json`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str
    dagster_run_id: str
    # A stopped run's: the error code of each unfinished request's entry.
    status: str | None = None
    model: str | None = None
    output_data_path: str | None = None
    num_requests: int
    num_errors: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    wall_s: float | None = None
    # Per shard worker while it generated (its completion tokens over its generate_s, engine start not
    # counted), as a shard's log reports it; over the shards that resumed nothing (a resumed one's tokens
    # include those its checkpoint kept). Null when none generated.
    completion_tokens_per_s: float | None = None
    # The job's completion tokens over wall_s (engine starts, planning and merging included): what
    # completion_tokens_per_s was before issue 46. And its slowest shard's engine start.
    completion_tokens_per_wall_s: float | None = None
    engine_start_s: float | None = None
    # Its prompt tokens per shard worker while it ran, as completion_tokens_per_s counts its completion
    # tokens: the throughput of a kind that generates none (embeddings), which the dry run estimates from.
    prompt_tokens_per_s: float | None = None
    merge_s: float | None = None
    finished_at: datetime | None = None
    # How the job ran where it differed from what it asked: fewer shards, outputs shared by repeats, the
    # dtype chosen for the hardware (each shard's choice and reason are in `shards`).
    data_parallelism: DataParallelism | None = None
    num_deduplicated: int | None = None
    num_cut_from_longer: int | None = None
    # Requests answered from the team's result cache (issue 49), and their tokens: in the totals above, but
    # computed by the earlier jobs each entry's `cached_from_job_id` names.
    num_cached: int | None = None
    cached_prompt_tokens: int | None = None
    cached_completion_tokens: int | None = None
    dtype: str | None = None
    # Whether the job's tool_config was applied (the code_evaluator loop serves v1 prompts only).
    tool_config: str | None = None
    shards: list[ShardEntry] | None = None
    # A stopped run's: results kept, requests left as error entries, and why.
    num_finished: int | None = None
    num_unfinished: int | None = None
    reason: str | None = None
    # A resumed job's: from what and which run, then its ResumeFigures.
    resumed_from: str | None = None
    resumed_from_run_id: str | None = None
    resume_requests_kept: int | None = None
    resume_requests_generated: int | None = None
    resume_completion_tokens_kept: int | None = None
    resume_completion_tokens_generated: int | None = None

    def with_resume(self, job: ResumedJob, requests_done: int, completion_tokens: int | None) -> JobMetadata:
        """The file of a resumed job adds what it was resumed from and its `resume_figures` (once its run
        counted its checkpoints); any other job's is as it is."""
        if (figures := resume_figures(job, requests_done, completion_tokens)) is None:
            return self
        resumed = {"resumed_from": job.resumed_from, "resumed_from_run_id": job.resumed_from_run_id}
        return self.model_copy(update=resumed | figures.model_dump(exclude_none=True))

    @field_serializer("finished_at")
    def _iso(self, finished_at: datetime | None) -> str | None:
        # As the file has always spelt it (`isoformat`: "+00:00", not pydantic's "Z").
        return finished_at.isoformat() if finished_at is not None else None

    def fields(self) -> dict[str, object]:
        """The file's fields, as JSON values (as Dagster's run metadata records them too)."""
        return self.model_dump(mode="json", exclude_unset=True)

    def to_json(self) -> str:
        return json.dumps(self.fields(), indent=2)

    @classmethod
    def from_json(cls, text: str | bytes) -> JobMetadata:
        return cls.model_validate(json.loads(text))


class AtomicFiles(Protocol):
    """Where the file is written: a job's data files (`DataFiles`), each written whole or not at all."""

    def atomic_write(self, path: str, mode: str = "w") -> AbstractContextManager[IO[Any]]: ...


def write_metadata(files: AtomicFiles, path: str, metadata: JobMetadata) -> None:
    """The one way the file is written, by a completed run and a stopped one alike: whole or not at all, so
    that a reader never sees half a file."""
    with files.atomic_write(path) as handle:
        handle.write(metadata.to_json())
