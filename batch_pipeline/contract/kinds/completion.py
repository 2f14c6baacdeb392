"""OpenAI completion requests (`prompt`: a string, strings, or token ids), the lines of `/v1/completions`
batches and v2 content's lists of them. The worker runs them with `worker/openai_requests.py`; the output
is an OpenAI `text_completion` object."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from batch_pipeline.contract.kinds.base import RequestKind, WorkRequest, estimated_tokens
from batch_pipeline.contract.kinds.v1 import prompt_before_last_line
from batch_pipeline.contract.openai import FilteredCompletionV2Request

# The output limit of a request that sets none, as in the OpenAI API.
DEFAULT_MAX_TOKENS = 16


class CompletionKind(RequestKind):
    name = "completion"
    wire_model = FilteredCompletionV2Request
    prompt_field = "prompt"
    described = "`prompt` (completion)"
    openai_url = "/v1/completions"
    inline_content = list[FilteredCompletionV2Request]
    output_limit_fields = ("max_tokens",)

    def work_requests(self, record: Any) -> Iterator[WorkRequest]:
        prompt = record.prompt
        prompts: list[Any]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompts = list(prompt)  # several prompts: strings, or lists of token ids
        else:
            prompts = [prompt]
        yield WorkRequest(
            record.model_dump(exclude_none=True, by_alias=True),
            [estimated_tokens(p) if isinstance(p, str) else len(p) for p in prompts],
            record.n or 1,
        )

    def expected_output_tokens(self, request: dict[str, Any]) -> int:
        return int(request.get("max_tokens", DEFAULT_MAX_TOKENS)) * (request.get("n") or 1)

    def shared_context(self, request: dict[str, Any]) -> str:
        return prompt_before_last_line(request.get("prompt"))


COMPLETION = CompletionKind()
