"""What a dry run answers (`POST /v2/batch-completions?dry_run=true`): the request read and tokenized as
the job would read it, and what it would cost here. Not a type of the spec: nothing is launched."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from batch_pipeline.contract.base import WireModel


class RequestProblem(WireModel):
    index: int = Field(description="The request's index in the job's output.")
    code: str = Field(
        description="As the error entry of a real run would have it: `prompt_too_long`, "
        "`invalid_request`, `unsupported_field`; or `output_past_context`."
    )
    message: str


class RuntimeEstimate(WireModel):
    """Wall time and machine hours if every request generates its maximum output, at the rate this
    deployment measured on its latest completed jobs of the model."""

    completion_tokens_per_s: float | None = Field(
        None,
        description="Completion tokens per second per shard worker while generating: the median over "
        "`from_jobs` jobs of their metadata's completion_tokens_per_s (a job's shards' tokens over their "
        "generate_s). Jobs of a release before it measured so count only where there are no others, each "
        "its tokens over its wall time divided by its shard workers. Null for a job of kinds that generate "
        "nothing (embeddings).",
    )
    prompt_tokens_per_s: float | None = Field(
        None,
        description="For a job of kinds that generate nothing (embeddings): prompt tokens per second per "
        "shard worker while its engine ran, the median over `from_jobs` such jobs of their metadata's "
        "prompt_tokens_per_s; null for any other.",
    )
    engine_start_s: float = Field(
        0.0,
        description="The median over those jobs of their slowest shard's engine start, which every worker "
        "pays before it generates; 0 where only older jobs are known.",
    )
    from_jobs: int = Field(description="The completed jobs of this model the rate is measured on.")
    workers: int = Field(description="Shard workers the job is expected to run in.")
    wall_s: float = Field(
        description="engine_start_s, then max_output_tokens at completion_tokens_per_s over `workers` workers "
        "(an embeddings job: prompt_tokens at prompt_tokens_per_s)."
    )
    worker_hours: float = Field(description="wall_s times workers, in hours.")
    gpu_hours: float | None = Field(None, description="worker_hours times the `gpus` asked for; null when none.")
    cpu_hours: float | None = Field(None, description="worker_hours times the `cpus` asked for; null when none.")


class BatchCompletionsEstimate(WireModel):
    dry_run: Literal[True] = Field(True, description="Always true: an estimate, nothing was launched or stored.")
    model: str
    context_length: int = Field(
        description="Tokens a prompt and its output share: model_config.max_model_len "
        "(or max_context_length), else the model's own."
    )
    num_requests: int = Field(description="Entries the job's output would have (v1 content: one per prompt).")
    num_prompts: int = Field(
        description="Prompts of the requests that can run, as given to the engine (a completion may list several)."
    )
    prompt_tokens: int = Field(
        description="Tokens of the prompts that can run, by the model's tokenizer, "
        "chat requests through the chat template."
    )
    max_output_tokens: int = Field(
        description="The most tokens the requests that can run may generate: max_tokens (max_new_tokens, "
        "max_completion_tokens) times n for each prompt, with the defaults the worker applies (16 for a "
        "completion; for a chat request that sets no limit, the model's generation config's, else 256 is "
        "assumed, as the job's planning does), and at most what the context leaves."
    )
    num_cannot_run: int = Field(description="Requests that would be error entries in the output.")
    cannot_run: list[RequestProblem] = Field(description="The first of them, with why.")
    num_cut_at_context: int = Field(
        description="Requests whose prompt and max output exceed the context: they run, and stop at the context."
    )
    cut_at_context: list[RequestProblem] = Field(description="The first of them.")
    estimate: RuntimeEstimate | None = Field(None, description="Null when there is no history to estimate from.")
    no_history: str | None = Field(None, description="Why there is no estimate.")
