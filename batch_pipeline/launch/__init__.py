"""Shard launchers: Dagster resources that run one shard worker and return its result (`launch.base`,
`launch.local`, `launch.k8s`), and the worker `batch-pipeline run` starts ahead (`launch.standby`), which
the command starts before it imports Dagster, for the launchers whose kind takes it (`launch.kinds`)."""
