"""The shard kernel shared by the orchestrator and the worker: the files a shard is made of, work items and
their sizes, planning, the merge, and the protocol between the two."""
