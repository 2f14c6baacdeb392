"""Shard launchers: Dagster resources that run one shard worker and return its result."""

from batch_pipeline.launch.base import ShardLauncher, ShardResult
from batch_pipeline.launch.local import LocalShardLauncher

__all__ = ["LocalShardLauncher", "ShardLauncher", "ShardResult"]
