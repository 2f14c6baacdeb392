"""Scale's v1 content (`prompts` sharing one set of sampling parameters): its wire model, fanned out to one
work item per prompt. The worker runs it with `worker/v1_requests.py`, and with the code_evaluator loop
where the job has a `tool_config`; the output is a `CompletionOutput`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from pydantic import Field, field_validator

from batch_pipeline.contract.base import WireModel
from batch_pipeline.contract.kinds.base import RequestKind, WorkRequest, estimated_tokens


class CreateBatchCompletionsV1RequestContent(WireModel):
    """Prompts sharing one set of sampling parameters."""

    text_fields = frozenset({"prompts", "stop_sequences"})

    prompts: list[str]
    max_new_tokens: int
    temperature: float = Field(ge=0.0, le=1.0)
    stop_sequences: list[str] | None = None
    return_token_log_probs: bool | None = False
    presence_penalty: float | None = Field(None, ge=0.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=0.0, le=2.0)
    top_k: int | None = Field(None, ge=-1)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    skip_special_tokens: bool | None = True

    # Not a bound of the spec's schema, but no engine can generate fewer than one token: refusing it here
    # names the field instead of failing every prompt of the batch later.
    @field_validator("max_new_tokens")
    @classmethod
    def _at_least_one_token(cls, value: int) -> int:
        if value < 1:
            raise ValueError("max_new_tokens must be at least 1")
        return value


class V1Kind(RequestKind):
    name = "v1"
    wire_model = CreateBatchCompletionsV1RequestContent
    prompt_field = "prompts"
    described = "`prompts` (v1 content)"
    inline_content = CreateBatchCompletionsV1RequestContent  # one object, not a list
    takes_tool_config = True
    output_limit_fields = ("max_new_tokens",)

    def work_requests(self, record: Any) -> Iterator[WorkRequest]:
        shared = record.model_dump(exclude={"prompts"}, exclude_none=True)
        for text in record.prompts:  # a work item per prompt, each with the content's parameters
            yield WorkRequest({"prompt": text, **shared}, [estimated_tokens(text)])

    def expected_output_tokens(self, request: dict[str, Any]) -> int:
        return int(request["max_new_tokens"])

    def shared_context(self, request: dict[str, Any]) -> str:
        return prompt_before_last_line(request["prompt"])


def prompt_before_last_line(prompt: Any) -> str:
    """A text prompt before its last line (the whole of it where it has one line); another prompt whole."""
    if isinstance(prompt, str):
        return prompt.rsplit("\n", 1)[0]
    return json.dumps(prompt)


V1 = V1Kind()
