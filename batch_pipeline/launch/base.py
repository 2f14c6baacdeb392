from __future__ import annotations

import time
from typing import Any

import dagster as dg

from batch_pipeline.shards import ShardTask


def raise_if_past_deadline(task: ShardTask) -> None:
    """A worker stopped by the job's deadline must not be retried: a retry would only stop again."""
    if task.deadline is not None and time.time() >= task.deadline:
        raise dg.Failure(
            f"max_runtime_sec exceeded: shard {task.shard.shard_index} was stopped at the job's deadline; "
            "its finished results are kept",
            allow_retries=False,
        )


def worker_stats(task: ShardTask, reports: list[Any]) -> dict[str, Any]:
    """The stats a worker reports last, as its Pipes custom message."""
    if not reports:
        raise dg.Failure(f"shard {task.shard.shard_index}: the worker exited without reporting its stats")
    return reports[-1]


class ShardLauncher(dg.ConfigurableResource):
    """Runs the shard worker for one task through Dagster Pipes, wherever the deployment puts it.

    Implementations: `LocalShardLauncher` (a subprocess on this machine); a Kubernetes launcher replaces it
    in production. A launcher returns the worker's stats, and raises when the worker fails, so that the
    step's retry policy starts it again and it resumes from its checkpoint.
    """

    def run_shard(self, context: dg.OpExecutionContext, task: ShardTask) -> dict[str, Any]:
        raise NotImplementedError
