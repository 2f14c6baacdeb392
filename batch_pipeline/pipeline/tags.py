"""The tags a job's run carries: who it is for (job id, model, labels), and what Dagster enforces
(priority in the queue, run monitoring's time limit)."""

from __future__ import annotations

from batch_pipeline.jobs_store import JobRecord
from batch_pipeline.priority import run_priority

JOB_ID_TAG = "batch_pipeline/job_id"
LABEL_TAG_PREFIX = "batch_pipeline/label/"
MODEL_TAG = "batch_pipeline/model"
# The shard workers stop at the job's deadline and fail the run with the reason; Dagster's run
# monitoring is the backstop (a run stuck outside the workers), so it acts only after this grace.
RUN_MONITORING_GRACE_S = 120
# Owner of the jobs a schedule's ticks store; the tick launches their runs, not the jobs sensor.
SCHEDULE_OWNER_PREFIX = "schedule:"


def run_tags(record: JobRecord) -> dict[str, str]:
    request = record.request
    tags = {
        JOB_ID_TAG: record.job_id,
        MODEL_TAG: request["model_config"]["model"],
        "dagster/priority": str(run_priority(record.priority)),
        "dagster/max_runtime": str((request.get("max_runtime_sec") or 86400) + RUN_MONITORING_GRACE_S),
    }
    for key, value in record.labels.items():
        tags[LABEL_TAG_PREFIX + key] = value
    return tags
