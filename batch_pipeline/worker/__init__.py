"""The shard worker (`python -m batch_pipeline.worker`): one vLLM engine over one shard's requests, results
checkpointed as they finish. It knows nothing of HTTP, the op graph or the job store."""
