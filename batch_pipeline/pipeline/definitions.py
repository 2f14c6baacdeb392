"""Everything Dagster loads: `dagster dev -m batch_pipeline.pipeline.definitions`."""

from __future__ import annotations

import os

import dagster as dg

from batch_pipeline.launch import LocalShardLauncher
from batch_pipeline.pipeline.job import SHARD_STEP_TAG, batch_completions
from batch_pipeline.pipeline.resources import JobStorage


def local_shard_concurrency() -> int:
    """How many shard workers may run at once on this machine: each holds a whole engine (~2.3 GiB for
    the catalog model on the CPU), and more workers than cores only share the same cores."""
    return int(os.environ.get("BATCH_PIPELINE_LOCAL_SHARD_CONCURRENCY", max(1, os.cpu_count() or 1)))


local_executor = dg.multiprocess_executor.configured(
    {
        "tag_concurrency_limits": [
            {"key": SHARD_STEP_TAG, "value": "shard", "limit": local_shard_concurrency()},
        ]
    },
    name="local_executor",
)

defs = dg.Definitions(
    jobs=[batch_completions],
    resources={
        "shard_launcher": LocalShardLauncher(),
        "job_storage": JobStorage(work_dir_base=os.environ.get("BATCH_PIPELINE_WORK_DIR", "")),
    },
    executor=local_executor,
)


def batch_completions_job() -> dg.JobDefinition:
    """The job with its resources bound, reconstructable in step processes (see `execute_request`)."""
    return defs.get_job_def("batch_completions")
