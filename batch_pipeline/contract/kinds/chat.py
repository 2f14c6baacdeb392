"""OpenAI chat completion requests (`messages`), the lines of `/v1/chat/completions` batches and v2
content's lists of them. The worker renders them through the model's chat template and runs them with
`worker/openai_requests.py`; the output is an OpenAI `chat.completion` object."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from batch_pipeline.contract.kinds.base import RequestKind, WorkRequest, estimated_tokens
from batch_pipeline.contract.openai import ChatMessage, FilteredChatCompletionV2Request

# The output a request that sets no limit is planned for (the engine may fill the context).
UNBOUNDED_OUTPUT_ESTIMATE = 256


class ChatKind(RequestKind):
    name = "chat"
    wire_model = FilteredChatCompletionV2Request
    prompt_field = "messages"
    described = "`messages` (chat)"
    openai_url = "/v1/chat/completions"
    inline_content = list[FilteredChatCompletionV2Request]
    # The newer name wins where both are set.
    output_limit_fields = ("max_completion_tokens", "max_tokens")

    def work_requests(self, record: Any) -> Iterator[WorkRequest]:
        yield WorkRequest(
            record.model_dump(exclude_none=True, by_alias=True),
            [sum(_message_tokens(message) for message in record.messages)],
            record.n or 1,
        )

    def expected_output_tokens(self, request: dict[str, Any]) -> int:
        limit = request.get("max_completion_tokens") or request.get("max_tokens") or UNBOUNDED_OUTPUT_ESTIMATE
        return int(limit) * (request.get("n") or 1)

    def shared_context(self, request: dict[str, Any]) -> str:
        """The conversation before its last message (the whole of a one-message one)."""
        messages = request["messages"]
        return json.dumps(messages[:-1] if len(messages) > 1 else messages)


def _message_tokens(message: ChatMessage) -> int:
    content = message.content
    if isinstance(content, str):
        return estimated_tokens(content)
    return sum(estimated_tokens(getattr(part, "text", "")) for part in content or [])


CHAT = ChatKind()
