"""The Dagster side: the job's op graph (job.py), the sensors that launch and record runs, schedules,
resources and the definitions Dagster loads. It orchestrates; inference happens in the shard workers."""
