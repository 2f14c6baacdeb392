"""What this deployment can serve of a valid request.

The contract accepts everything the spec allows; the parts not served here are refused before any work
starts, each with the field that asks for them: by the API as a 422, by the job (launchpad runs) as a
failed validate_input step.
"""

from __future__ import annotations

import os
from pathlib import Path

from batch_pipeline import io
from batch_pipeline.contract import CreateBatchCompletionsV2Request
from batch_pipeline.worker.code_evaluator import TOOL_NAME

DATA_ROOTS_ENV = "BATCH_PIPELINE_DATA_ROOTS"
MAX_EXECUTION_TIMEOUT_S = 600


def data_roots() -> list[Path]:
    """Directories local input and output paths must lie in (`BATCH_PIPELINE_DATA_ROOTS`, separated by
    the OS path separator); none configured = any local path."""
    return [Path(root).resolve() for root in os.environ.get(DATA_ROOTS_ENV, "").split(os.pathsep) if root]


def outside_data_roots(path: str, roots: list[Path]) -> bool:
    """Whether a local path escapes every root once `..` and symlinks are resolved; URLs are not local."""
    if not roots or not io.is_local(path):
        return False
    resolved = Path(path.removeprefix("file://")).resolve()
    return not any(resolved == root or root in resolved.parents for root in roots)


def refusals(request: CreateBatchCompletionsV2Request) -> list[tuple[str, str]]:
    """`(field, why)` for each part of the request this deployment cannot honour."""
    found = []
    roots = data_roots()
    for field in ("input_data_path", "output_data_path"):
        path = getattr(request, field)
        if path is not None and outside_data_roots(path, roots):
            found.append((field, f"{path} is outside the data roots this server may read and write"))
    found.extend(_tool_refusals(request))
    if request.nodes_per_worker is not None and request.nodes_per_worker > 1:
        found.append(("nodes_per_worker", "multi-node workers are not supported; use data_parallelism"))
    return found


def _tool_refusals(request: CreateBatchCompletionsV2Request) -> list[tuple[str, str]]:
    tool_config = request.tool_config
    if tool_config is None:
        return []
    found = []
    if tool_config.name != TOOL_NAME:
        found.append(("tool_config.name", f"unknown tool {tool_config.name!r}; the one tool is {TOOL_NAME!r}"))
    if isinstance(request.content, list):
        found.append(("tool_config", "the code_evaluator loop serves v1 content (prompts); v2 chat requests "
                                     "declare functions in `tools` instead"))
    timeout = tool_config.execution_timeout_seconds
    if timeout is not None and timeout > MAX_EXECUTION_TIMEOUT_S:
        found.append(("tool_config.execution_timeout_seconds", f"at most {MAX_EXECUTION_TIMEOUT_S} s an execution"))
    return found
