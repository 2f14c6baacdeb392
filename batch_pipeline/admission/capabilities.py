"""What this deployment can serve of a valid request.

The contract accepts everything the spec allows; the parts not served here are refused before any work
starts, each with the field that asks for them: by the API as a 422, by the job (launchpad runs) as a
failed validate_input step.
"""

from __future__ import annotations

import difflib

from batch_pipeline.admission.hardware import engine_argument_refusals, hardware_refusals
from batch_pipeline.admission.paths import request_path_refusals
from batch_pipeline.admission.policy import AdmissionPolicy
from batch_pipeline.contract import CreateBatchCompletionsV1RequestContent, CreateBatchCompletionsV2Request
from batch_pipeline.contract.requests import CODE_EVALUATOR
from batch_pipeline.models.catalog import CATALOG, context_tokens, runner_of

MAX_EXECUTION_TIMEOUT_S = 600


def refusals(
    request: CreateBatchCompletionsV2Request, owner: str | None, policy: AdmissionPolicy, own_dir: str | None = None
) -> list[tuple[str, str]]:
    """`(field, why)` for each part of `owner`'s request that `policy` does not admit (`own_dir`: the job's
    work dir, see request_path_refusals)."""
    found = request_path_refusals(request, policy.paths_for(owner), own_dir)
    if request.model_cfg.trust_remote_code and not policy.allow_remote_code:
        found.append(
            (
                "model_config.trust_remote_code",
                "this server does not run a model's own code "
                "(the operator allows it with BATCH_PIPELINE_ALLOW_REMOTE_CODE=1)",
            )
        )
    found.extend(_tool_refusals(request))
    found.extend(length_refusals(request))
    found.extend(_model_refusals(request))
    found.extend(hardware_refusals(request, policy.hardware_maxima))
    found.extend(engine_argument_refusals(request.model_cfg, policy.engine_maxima, policy.max_gpus))
    if request.nodes_per_worker is not None and request.nodes_per_worker > 1:
        found.append(("nodes_per_worker", "multi-node workers are not supported; use data_parallelism"))
    return found


def scale_model_refusals(request: CreateBatchCompletionsV2Request) -> list[tuple[str, str]]:
    """Scale's batch completions generate text, whatever their content: a catalog model that only embeds
    (all-minilm-l6-v2) could answer none of a job's requests, each after its engine started. Its embeddings
    are OpenAI batch lines (`/v1/embeddings`), which do not come this way."""
    config = request.model_cfg
    if config.checkpoint_path is None and runner_of(config.model) == "pooling":
        return [
            (
                "model_config.model",
                f"{config.model!r} computes embeddings and generates no text; batch completions need a model "
                "that generates (embeddings: an OpenAI batch of /v1/embeddings lines)",
            )
        ]
    return []


def _model_refusals(request: CreateBatchCompletionsV2Request) -> list[tuple[str, str]]:
    """A name one typo from a catalog model's is that model misspelled, not a Hugging Face id: refused now,
    not after its shard's engine searched the hub for it, retried, and failed minutes later."""
    config = request.model_cfg
    name = config.model.lower()
    if config.checkpoint_path is not None or name in CATALOG or "/" in name or ":" in name:
        return []
    near = [
        catalog
        for catalog in CATALOG
        if catalog.startswith(name)
        or name.startswith(catalog)
        or difflib.SequenceMatcher(None, name, catalog).ratio() >= 0.75
    ]
    if not near:
        return []
    return [
        (
            "model_config.model",
            f"{config.model!r} is no model of the catalog: did you mean {near[0]!r}? "
            "(`batch-pipeline models` lists them; a Hugging Face id is org/name)",
        )
    ]


def length_refusals(request: CreateBatchCompletionsV2Request, context: int | None = None) -> list[tuple[str, str]]:
    """v1 content's max_new_tokens holds for every prompt: past the model's context, every request of the job
    would fail at its shard. (A list's request past it fails alone, as an error entry at its index.)
    `context`: the model's as its engine read it (a dry run's reading); else the request's max_model_len or
    the catalog's."""
    if not isinstance(request.content, CreateBatchCompletionsV1RequestContent):
        return []
    context = context or request.model_cfg.max_model_len or context_tokens(request.model_cfg.model)
    wanted = request.content.max_new_tokens
    if context is None or wanted < context:
        return []
    return [
        (
            "content.max_new_tokens",
            f"{wanted} tokens do not fit the model's context of {context} tokens with any prompt: "
            f"at most {context - 1}",
        )
    ]


def _tool_refusals(request: CreateBatchCompletionsV2Request) -> list[tuple[str, str]]:
    # With a list of requests the tool is accepted, as Scale's server does, and not applied: the shard
    # workers run the requests without it and the job's metadata says so (`tool_config`).
    tool_config = request.tool_config
    if tool_config is None:
        return []
    found = []
    if tool_config.name != CODE_EVALUATOR:
        found.append(("tool_config.name", f"unknown tool {tool_config.name!r}; the one tool is {CODE_EVALUATOR!r}"))
    timeout = tool_config.execution_timeout_seconds
    if timeout is not None and timeout > MAX_EXECUTION_TIMEOUT_S:
        found.append(("tool_config.execution_timeout_seconds", f"at most {MAX_EXECUTION_TIMEOUT_S} s an execution"))
    return found
