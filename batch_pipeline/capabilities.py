"""What this deployment can serve of a valid request.

The contract accepts everything the spec allows; the parts not served here are refused before any work
starts, each with the field that asks for them: by the API as a 422, by the job (launchpad runs) as a
failed validate_input step.
"""

from __future__ import annotations

from batch_pipeline.contract import CreateBatchCompletionsV2Request


def refusals(request: CreateBatchCompletionsV2Request) -> list[tuple[str, str]]:
    """`(field, why)` for each part of the request this deployment cannot honour."""
    found = []
    if request.tool_config is not None:
        found.append(("tool_config", "tool use is not supported by this deployment yet"))
    if request.nodes_per_worker is not None and request.nodes_per_worker > 1:
        found.append(("nodes_per_worker", "multi-node workers are not supported; use data_parallelism"))
    if isinstance(request.content, list):
        found.append(
            ("content", "lists of completion or chat requests are not served yet; send v1 content (prompts)")
        )
    return found
