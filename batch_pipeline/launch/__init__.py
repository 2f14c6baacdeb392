"""Shard launchers: Dagster resources that run one shard worker and return its stats."""

from batch_pipeline.launch.base import ShardLauncher
from batch_pipeline.launch.local import LocalShardLauncher

__all__ = ["LocalShardLauncher", "ShardLauncher"]
