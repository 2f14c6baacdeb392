from __future__ import annotations

import os
import sys
import time
from typing import Any

import dagster as dg
from pydantic import Field

from batch_pipeline.launch.base import ShardLauncher
from batch_pipeline.shards import ShardTask


def local_shard_concurrency() -> int:
    """How many shard workers may run at once on this machine: each holds a whole engine (~2.3 GiB for
    the catalog model on the CPU), and more workers than cores only share the same cores."""
    return int(os.environ.get("BATCH_PIPELINE_LOCAL_SHARD_CONCURRENCY", max(1, os.cpu_count() or 1)))


def raise_if_past_deadline(task: ShardTask) -> None:
    """A worker stopped by the job's deadline must not be retried: a retry would only stop again."""
    if task.deadline is not None and time.time() >= task.deadline:
        raise dg.Failure(
            f"max_runtime_sec exceeded: shard {task.shard.shard_index} was stopped at the job's deadline; "
            "its finished results are kept",
            allow_retries=False,
        )


class LocalShardLauncher(ShardLauncher):
    """The shard worker as a subprocess of the step, on this machine."""

    python_executable: str = Field(
        default="", description="Python that runs the worker; empty = the one running Dagster."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for the worker.")

    def run_shard(self, context: dg.OpExecutionContext, task: ShardTask) -> dict[str, Any]:
        client = dg.PipesSubprocessClient(env={**self._cpu_share(task), **self.env})
        try:
            completed = client.run(
                context=context,
                command=[self.python_executable or sys.executable, "-m", "batch_pipeline.worker"],
                extras={"task": task.to_dict()},
            )
        except Exception:  # the worker failed (Dagster's error type for it is not public API)
            raise_if_past_deadline(task)
            raise
        reports = completed.get_custom_messages()
        if not reports:
            raise dg.Failure(f"shard {task.shard.shard_index}: the worker exited without reporting its stats")
        return reports[-1]

    @staticmethod
    def _cpu_share(task: ShardTask) -> dict[str, str]:
        """Shards running side by side split the cores instead of all computing on the same ones.

        vLLM's CPU backend binds its threads to the same cores in every process; two engines so bound ran
        2.5x slower than two with one unbound thread each (measured: 64 prompts over 2 shards, 2 cores).
        """
        side_by_side = min(task.shard_count, local_shard_concurrency())
        if side_by_side <= 1:
            return {}
        threads = max(1, (os.cpu_count() or 1) // side_by_side)
        return {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
