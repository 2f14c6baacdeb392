"""The job store's tables, as the newest migration leaves them (`store/migrations/`), and a job's statuses."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from enum import StrEnum

import sqlalchemy as sa

from batch_pipeline.store.sql import utc

metadata = sa.MetaData()
# Not Alembic's default name: the job store may share a database with Dagster's own storage.
SCHEMA_VERSION_TABLE = "batch_pipeline_schema_version"


class JobStatus(StrEnum):
    """A job's status as its row holds it. The wire's status (`contract.jobs.BatchCompletionsJobStatus`) has
    these and `unknown`; the contract cannot import the store, so a test keeps the two equal."""

    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_finished(self) -> bool:
        return self in FINISHED


FINISHED = frozenset({JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED})


def failed_at_deadline(
    status: str, failure_reason: str | None, completed_at: datetime | None, expires_at: datetime | None
) -> bool:
    """Whether a job failed at its deadline (an OpenAI batch's completion window): it ended at or past it,
    or its reason says so (stopped by run monitoring, or found past it when its run started). What a batch
    reads as `expired` (`openai_batch.jobs.expired`) and its end's webhook event announces, from a record
    or from a row as a transaction reads it (naive datetimes are UTC)."""
    if status != JobStatus.FAILED:
        return False
    if completed_at is not None and expires_at is not None and utc(completed_at) >= utc(expires_at):
        return True
    return (failure_reason or "").startswith("max_runtime_sec exceeded")


JOB_ID_LENGTH = 64  # the job_id column's bound

jobs = sa.Table(
    "batch_jobs",
    metadata,
    sa.Column("job_id", sa.String(JOB_ID_LENGTH), primary_key=True),
    sa.Column("owner", sa.String(128), nullable=False, index=True),
    sa.Column("idempotency_key", sa.String(256), nullable=True),
    # The request as stored: inline content is not in it but in the file `content_path` names.
    sa.Column("request", sa.Text, nullable=False),
    sa.Column("request_sha256", sa.String(64), nullable=True),  # what an Idempotency-Key was first used for
    sa.Column("content_path", sa.Text, nullable=True),
    sa.Column("content_bytes", sa.BigInteger, nullable=True),  # the size of that file, as written
    sa.Column("model", sa.String(256), nullable=True),
    sa.Column("priority", sa.String(64), nullable=True),
    sa.Column("labels", sa.Text, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, index=True),
    sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("run_id", sa.String(64), nullable=True, index=True),  # the newest run of the job
    sa.Column("status", sa.String(16), nullable=False, server_default=JobStatus.QUEUED.value),
    sa.Column("status_detail", sa.Text, nullable=True),  # e.g. why a run is being retried
    sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
    # Its latest run's start, and the seconds its earlier runs ran: what fair share and usage charge.
    sa.Column("run_started_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("earlier_runs_s", sa.Float, nullable=True),
    sa.Column("queue_wait_s", sa.Float, nullable=True),  # submission to first run start
    sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("cancelled_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("failed_at", sa.DateTime(timezone=True), nullable=True),  # the job could not become a run
    sa.Column("failure_reason", sa.Text, nullable=True),
    # Totals over the shards, kept with each progress report; final figures when the job completes.
    sa.Column("requests_total", sa.BigInteger, nullable=True),
    sa.Column("requests_done", sa.BigInteger, nullable=True),
    sa.Column("errors", sa.BigInteger, nullable=True),
    sa.Column("prompt_tokens", sa.BigInteger, nullable=True),
    sa.Column("completion_tokens", sa.BigInteger, nullable=True),
    sa.Column("results", sa.Text, nullable=True),  # the finished job's summary (JSON), as in its metadata file
    # Fair share: the end up to which the job's use of run slots is counted in its team's `team_usage` row.
    sa.Column("usage_counted_until", sa.DateTime(timezone=True), nullable=True),
    # Resume (POST .../actions/resume): how many times the job was resumed (its runs' `batch_pipeline/resume`
    # tag), the last time from which status and run, with which Idempotency-Key, and what its checkpoints
    # already held then (kept, never generated again), as that resume's first run counted them.
    sa.Column("resume_count", sa.Integer, nullable=True),
    sa.Column("resumed_from", sa.String(16), nullable=True),
    sa.Column("resumed_from_run_id", sa.String(64), nullable=True),
    sa.Column("resumed_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("resume_idempotency_key", sa.String(256), nullable=True),
    sa.Column("requests_kept", sa.BigInteger, nullable=True),
    sa.Column("prompt_tokens_kept", sa.BigInteger, nullable=True),
    sa.Column("completion_tokens_kept", sa.BigInteger, nullable=True),
    # Retention (the `cleanup` schedule, `store/retention.py`): when the finished job's work dir (its inline
    # content, shard inputs, checkpoints) was deleted; from then on its content_bytes and checkpoint_bytes
    # are 0 and it cannot be resumed. The user's named output is never deleted.
    sa.Column("work_dir_deleted_at", sa.DateTime(timezone=True), nullable=True),
    # The shard plan the job's first run made (JSON, `shards.planning.RecordedPlan`): every later run of it
    # writes the same shards, since each checkpointed result lies in the shard that plan put its request in.
    sa.Column("shard_plan", sa.Text, nullable=True),
    # Its shards' checkpoint bytes (`batch_job_shards.checkpoint_bytes`, summed): counted in the team's stored
    # bytes with its content_bytes, 0 once retention deleted the work dir.
    sa.Column("checkpoint_bytes", sa.BigInteger, nullable=True),
    # The tokens admission estimated the job to use: held against its team's max_tokens_per_day until it ends
    # (the larger of this and what it has used so far), then replaced by what it used.
    sa.Column("estimated_tokens", sa.BigInteger, nullable=True),
    # How far its shards have got (`batch_job_shards.phase`: the furthest one's), so that a status read says
    # "starting engine" or "generating" from this row alone.
    sa.Column("shard_phase", sa.String(16), nullable=True),
    # The result cache (issue 49): requests its plan answered from its team's cache, and their tokens (in
    # its prompt and completion tokens too, but computed by an earlier job), set when it is planned.
    sa.Column("cached_requests", sa.BigInteger, nullable=True),
    sa.Column("cached_prompt_tokens", sa.BigInteger, nullable=True),
    sa.Column("cached_completion_tokens", sa.BigInteger, nullable=True),
    # The kind of its requests (`contract/kinds`' names, or `mixed`), as its submission or its plan read them:
    # what /metrics counts jobs, requests and tokens by. NULL until known (an input file's, until planned).
    sa.Column("request_kind", sa.String(16), nullable=True),
    sa.UniqueConstraint("owner", "idempotency_key", name="uq_owner_idempotency_key"),
    sa.Index("ix_batch_jobs_owner_created", "owner", "created_at", "job_id"),
    sa.Index("ix_batch_jobs_status_created", "status", "created_at"),
    sa.Index("ix_batch_jobs_owner_completed", "owner", "completed_at"),  # a team's tokens of the day
    # Fair share's reads each tick: the ended jobs not yet counted, the running ones, the waiting ones.
    sa.Index("ix_batch_jobs_usage_uncounted", "usage_counted_until", "completed_at"),
    sa.Index("ix_batch_jobs_holding", "completed_at", "started_at"),
    sa.Index("ix_batch_jobs_waiting", "status", "run_id", "created_at", "job_id", "owner", "priority", "expires_at"),
    # Retention's read each tick: the ended jobs whose work dirs are still kept, the longest ended first.
    sa.Index("ix_batch_jobs_retention", "work_dir_deleted_at", "completed_at"),
)

# Fair share: each team's decayed slot-seconds of its ended jobs, as they count at `as_of`.
team_usage = sa.Table(
    "batch_team_usage",
    metadata,
    sa.Column("owner", sa.String(128), primary_key=True),
    sa.Column("usage", sa.Float, nullable=False),
    sa.Column("as_of", sa.DateTime(timezone=True), nullable=False),
)

job_labels = sa.Table(
    "batch_job_labels",
    metadata,
    sa.Column("job_id", sa.String(64), primary_key=True),
    sa.Column("key", sa.Text, primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
    # Keys and values have no bound: the index holds their digest, the query compares both.
    sa.Column("digest", sa.String(64), nullable=False),
    sa.Index("ix_batch_job_labels_digest", "digest", "job_id"),
)

job_shards = sa.Table(
    "batch_job_shards",
    metadata,
    sa.Column("job_id", sa.String(64), primary_key=True),
    sa.Column("shard_index", sa.Integer, primary_key=True),
    sa.Column("requests_total", sa.BigInteger, nullable=False),
    sa.Column("requests_done", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("errors", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("prompt_tokens", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("completion_tokens", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=True),
    # The bytes of its checkpoint (results.tsv, and output.tsv once complete), as measured when the shard was
    # planned and when each of its attempts ended.
    sa.Column("checkpoint_bytes", sa.BigInteger, nullable=False, server_default="0"),
    # What the launcher gave its worker (cores, or a pod's GPU or CPU limit): the unit of its slot-seconds.
    sa.Column("charged_units", sa.Float, nullable=True),
    # Where its current attempt is (`ShardPhase`): NULL until its step starts a worker.
    sa.Column("phase", sa.String(16), nullable=True),
    # Its completed attempt's engine, where it ran in the warm engine pool (NULL elsewhere, and until then):
    # whether it found the engine built, and the start that saved. /metrics counts them.
    sa.Column("engine_warm", sa.Boolean, nullable=True),
    sa.Column("engine_start_saved_s", sa.Float, nullable=True),
)


# The result cache (issue 49, `store/result_cache.py`): a team's deterministic results of its completed jobs,
# by a digest of everything that decides them (`shards.result_cache.CacheIdentity`). The row is the index;
# the output itself is a line of the payload file its job wrote (work storage), read at `offset`.
result_cache = sa.Table(
    "batch_result_cache",
    metadata,
    sa.Column("owner", sa.String(128), primary_key=True),
    sa.Column("key", sa.String(32), primary_key=True),  # 128-bit digest, hex
    sa.Column("job_id", sa.String(JOB_ID_LENGTH), nullable=False),  # the job that computed it
    sa.Column("model", sa.String(256), nullable=False),
    sa.Column("weights_digest", sa.String(64), nullable=False),
    sa.Column("payload_path", sa.Text, nullable=False),
    sa.Column("payload_offset", sa.BigInteger, nullable=False),
    sa.Column("payload_length", sa.Integer, nullable=False),
    sa.Column("prompt_tokens", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("completion_tokens", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Index("ix_batch_result_cache_owner_created", "owner", "created_at"),
    sa.Index("ix_batch_result_cache_owner_model", "owner", "model", "weights_digest"),
)

# A model's weights digest, as last computed for its files as they were then (their sizes and mtimes):
# hashing a model's files is read once per change, not once per job.
model_weights = sa.Table(
    "batch_model_weights",
    metadata,
    sa.Column("path", sa.String(1024), primary_key=True),
    sa.Column("stat", sa.String(64), nullable=False),  # digest of the files' names, sizes and mtimes
    sa.Column("digest", sa.String(64), nullable=False),
    sa.Column("computed_at", sa.DateTime(timezone=True), nullable=False),
)

# Webhooks (issue 28): the outbox. One row per event, written in the transaction that ends its job, so
# that no end is lost and none is announced that did not happen; the delivery process (`webhooks/`) sends
# it to the endpoints of the job's team, as the tenants file names them when it is sent, and keeps here
# how that went. Delivered at least once: `webhook-id` is the event id, for receivers to drop repeats.
webhook_events = sa.Table(
    "batch_webhook_events",
    metadata,
    sa.Column("event_id", sa.String(64), primary_key=True),  # "evt_..."; the webhook-id header
    sa.Column("job_id", sa.String(JOB_ID_LENGTH), nullable=False, index=True),
    sa.Column("owner", sa.String(128), nullable=False),  # the job's owner, copied in the same transaction
    sa.Column("type", sa.String(32), nullable=False),  # job.completed, ..., batch.completed, ...
    sa.Column("payload", sa.Text, nullable=False),  # the body sent, as signed
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    # pending (to be sent), delivered (every subscribed endpoint answered 2xx), failed (given up after the
    # retry window), unsubscribed (no endpoint of the team takes this type).
    sa.Column("state", sa.String(16), nullable=False, server_default="pending"),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("last_attempt_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("last_error", sa.Text, nullable=True),  # e.g. "webhooks[0]: HTTP 500"; never a URL or secret
    sa.Column("delivered_to", sa.Text, nullable=False, server_default="[]"),  # endpoint ids that took it (JSON)
    sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
    sa.Index("ix_batch_webhook_events_due", "state", "next_attempt_at"),
)


def label_digest(key: str, value: str) -> str:
    return hashlib.sha256(json.dumps([key, value]).encode()).hexdigest()
