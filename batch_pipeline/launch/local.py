from __future__ import annotations

import sys
from typing import Any

import dagster as dg
from pydantic import Field

from batch_pipeline.launch.base import ShardLauncher
from batch_pipeline.shards import ShardTask


class LocalShardLauncher(ShardLauncher):
    """The shard worker as a subprocess of the step, on this machine."""

    python_executable: str = Field(
        default="", description="Python that runs the worker; empty = the one running Dagster."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for the worker.")

    def run_shard(self, context: dg.OpExecutionContext, task: ShardTask) -> dict[str, Any]:
        client = dg.PipesSubprocessClient(env=self.env)
        completed = client.run(
            context=context,
            command=[self.python_executable or sys.executable, "-m", "batch_pipeline.worker"],
            extras={"task": task.to_dict()},
        )
        reports = completed.get_custom_messages()
        if not reports:
            raise dg.Failure(f"shard {task.shard.shard_index}: the worker exited without reporting its stats")
        return reports[-1]
