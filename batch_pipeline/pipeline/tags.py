"""The tags a job's run carries: who it is for (job id, model, labels), and what Dagster enforces
(priority in the queue, the job's deadline through run monitoring, retries of a crashed run)."""

from __future__ import annotations

import hashlib
import re

from batch_pipeline.contract.priority import run_priority
from batch_pipeline.store.records import JobRecord
from batch_pipeline.tenancy.tenants import TEAM_OWNER_PREFIX

JOB_ID_TAG = "batch_pipeline/job_id"
# The signature that makes the run its job's (pipeline/runs.py): the job id tag alone is anyone's to set.
LAUNCH_TAG = "batch_pipeline/launch"
# The team that owns the job, for operators: set from the job's row, never read back as proof of anything.
TEAM_TAG = "batch_pipeline/team"
# One namespace section, as Dagster allows a tag key (it deprecates others, to refuse them later).
LABEL_TAG_PREFIX = "batch_pipeline.label/"
# What Dagster allows of a tag key's section (dagster._utils.tags.VALID_TAG_KEY_REGEX).
_TAG_KEY_SECTION = re.compile(r"[A-Za-z0-9_.-]{1,63}")
# How `label_tag_key` ends a key it wrote: a key that ends so is written too, or it could be another's.
_DIGEST_END = re.compile(r".*-[0-9a-f]{16}")
MODEL_TAG = "batch_pipeline/model"
# The job's deadline in epoch seconds: its expires_at (submission + max_runtime_sec). Every run of the job,
# retries included, stops at this instant, however long it waited in the queue.
DEADLINE_TAG = "batch_pipeline/deadline"
# How many times the job was resumed (`POST .../actions/resume`) when the run was made; absent on the runs
# of a job never resumed. The jobs sensor and the API tell a resumed job's new run from its old ones by it.
RESUME_TAG = "batch_pipeline/resume"
# On a `keep_partial_results` run: the stopped run whose finished results it merges.
STOPPED_RUN_TAG = "batch_pipeline/stopped_run_id"
# Run monitoring's limit counts from run start; the run sets it from the deadline when it starts.
MAX_RUNTIME_TAG = "dagster/max_runtime"
# The shard workers stop at the job's deadline and fail the run with the reason; Dagster's run
# monitoring is the backstop (a run stuck outside the workers), so it acts only after this grace.
RUN_MONITORING_GRACE_S = 120
# Owner of the jobs a schedule's ticks store; the tick launches their runs, not the jobs sensor.
SCHEDULE_OWNER_PREFIX = "schedule:"
# A run whose run worker died (a preempted node, an OOM-killed pod) is retried by the daemon (the
# instance's `run_retries`). Every shard step is planned again, since re-executing from failure would not
# reselect a shard that never started; finished shards find their checkpoints complete, so that costs
# seconds. A run that failed for a reason of its own (bad input, a worker error, the deadline) would only
# fail again: it is not retried.
MAX_RUN_RETRIES = 2
RUN_RETRY_TAGS = {
    "dagster/max_retries": str(MAX_RUN_RETRIES),
    "dagster/retry_strategy": "ALL_STEPS",
    "dagster/retry_on_asset_or_op_failure": "false",
}


def run_tags(record: JobRecord, priority_cap: int | None) -> dict[str, str]:
    """The run's tags; `priority_cap`: the highest priority the job's team may run at (None: no bound)."""
    request = record.request
    tags = {
        JOB_ID_TAG: record.job_id,
        MODEL_TAG: request["model_config"]["model"],
        "dagster/priority": str(run_priority(record.priority, priority_cap)),
        DEADLINE_TAG: repr(record.expires_at.timestamp()),
        # An upper bound until the run starts and counts it from the deadline (`max_runtime_from`).
        MAX_RUNTIME_TAG: str(int((record.expires_at - record.created_at).total_seconds()) + RUN_MONITORING_GRACE_S),
        **RUN_RETRY_TAGS,
    }
    if record.resume_count:
        tags[RESUME_TAG] = str(record.resume_count)
        # From the resume, whose deadline counts from then.
        since = record.resumed_at or record.created_at
        tags[MAX_RUNTIME_TAG] = str(int((record.expires_at - since).total_seconds()) + RUN_MONITORING_GRACE_S)
    if record.owner.startswith(TEAM_OWNER_PREFIX):
        tags[TEAM_TAG] = record.owner.removeprefix(TEAM_OWNER_PREFIX)
    for key, value in record.labels.items():
        tags[label_tag_key(key)] = value
    return tags


def label_tag_key(key: str) -> str:
    """The run tag of label `key`: the key itself where Dagster allows it in a tag key (letters, digits,
    `_`, `-`, `.`, at most 63), else what it allows of the key and a digest of the whole key, so that two
    labels of a job keep two tags (a label may have any key of up to 64 characters)."""
    if _TAG_KEY_SECTION.fullmatch(key) and not _DIGEST_END.fullmatch(key):
        return LABEL_TAG_PREFIX + key
    kept = re.sub(r"[^A-Za-z0-9_.-]+", "_", key)[:46]
    # surrogatepass: a row an older release stored may hold a lone surrogate, which the API now refuses.
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    return f"{LABEL_TAG_PREFIX}{kept}-{digest}"


def run_key(record: JobRecord) -> str:
    """The run key of the job's run: its id, and for a resumed job which resume (one run per resume)."""
    return f"{record.job_id}:resume-{record.resume_count}" if record.resume_count else record.job_id


def max_runtime_from(deadline: float, run_start: float) -> str:
    """Run monitoring's limit for a run that started at `run_start`: the job's deadline plus the grace."""
    return str(max(1, int(deadline - run_start) + RUN_MONITORING_GRACE_S))
