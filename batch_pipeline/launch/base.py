from __future__ import annotations

from typing import Any

import dagster as dg

from batch_pipeline.shards import ShardTask


class ShardLauncher(dg.ConfigurableResource):
    """Runs the shard worker for one task through Dagster Pipes, wherever the deployment puts it.

    Implementations: `LocalShardLauncher` (a subprocess on this machine); a Kubernetes launcher replaces it
    in production. A launcher returns the worker's stats, and raises when the worker fails, so that the
    step's retry policy starts it again and it resumes from its checkpoint.
    """

    def run_shard(self, context: dg.OpExecutionContext, task: ShardTask) -> dict[str, Any]:
        raise NotImplementedError
