"""The kinds of shard launcher a deployment chooses among (BATCH_PIPELINE_SHARD_LAUNCHER), each with what a
composition root must know of it before it imports the launcher, which imports Dagster: whether
`batch-pipeline run` starts a shard worker ahead on this machine for it (`launch.standby`), which it does
before that import. Each launcher class names its kind (`ShardLauncher.kind`); a new launcher (a pool of
warm engines) adds its kind here, saying what it takes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LauncherKind:
    name: str  # as BATCH_PIPELINE_SHARD_LAUNCHER names it
    # Its first shard may run in the worker `batch-pipeline run` started ahead, on this machine.
    takes_standby: bool


LOCAL = LauncherKind("local", takes_standby=True)
# A pod per shard: a worker waiting on this machine would only take its cores.
KUBERNETES = LauncherKind("k8s", takes_standby=False)
LAUNCHER_KINDS = {kind.name: kind for kind in (LOCAL, KUBERNETES)}
