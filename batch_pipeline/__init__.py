"""batch_pipeline: Scale LLM Engine's batch completions API (and OpenAI's Batch API) served by Dagster runs
on vLLM. docs/architecture.md ("Reading the code") follows a request from its route to its output file."""
