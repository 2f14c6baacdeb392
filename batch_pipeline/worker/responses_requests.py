"""OpenAI Responses API requests (`/v1/responses` lines) as chat requests of the shard's engine: the
instructions and input become the conversation, run through the chat kind's machinery (the model's chat
template, the server's sampling defaults, structured outputs for a JSON schema `text.format`); the item's
output is OpenAI's `response` object.

A field a batch cannot honour is refused for its line only, naming the field; the rest of the batch runs.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from batch_pipeline.contract import BatchCompletionsModelConfig
from batch_pipeline.contract.kinds import CHAT
from batch_pipeline.contract.kinds.responses import ResponsesRequest, TextFormatJsonObject, TextFormatJsonSchema
from batch_pipeline.shards.format import WorkItem
from batch_pipeline.worker.handlers import RequestRefused
from batch_pipeline.worker.openai_requests import ChatRequests

# Content part types honoured: the text of a message (an earlier assistant turn's as the API returned it).
_TEXT_PARTS = frozenset({"input_text", "output_text"})


def _refuse_unsupported(request: ResponsesRequest) -> None:
    """The fields no batch line can have honoured, each refused naming it."""
    refused: list[tuple[str, bool, str]] = [
        ("tools", bool(request.tools), "tools are not available to a batch job; leave tools unset or empty"),
        (
            "tool_choice",
            request.tool_choice not in (None, "auto", "none"),
            "without tools only 'auto' or 'none' can be honoured",
        ),
        (
            "previous_response_id",
            request.previous_response_id is not None,
            "responses are not stored between requests; send the whole conversation as input",
        ),
        (
            "conversation",
            request.conversation is not None,
            "conversations are not stored; send the whole conversation as input",
        ),
        ("prompt", request.prompt is not None, "prompt templates are not stored here; send the input itself"),
        ("background", bool(request.background), "a batch line always runs in the background of its batch"),
        ("stream", bool(request.stream), "batch jobs do not stream; leave stream unset or false"),
        ("include", bool(request.include), "no additional output data is available; leave include unset"),
        ("reasoning", request.reasoning is not None, "reasoning options are not supported by this engine"),
    ]
    for field, asked, why in refused:
        if asked:
            raise RequestRefused("unsupported_field", field, why)


def chat_request(request: ResponsesRequest) -> dict[str, Any]:
    """The chat completion request a responses request is run as: instructions as a system message, then
    the input's messages; its limit, sampling and text format in the chat request's fields."""
    messages: list[dict[str, Any]] = []
    if request.instructions is not None:
        messages.append({"role": "system", "content": request.instructions})
    for position, item in enumerate(request.items()):
        where = f"input.{position}"
        if item.type != "message":
            raise RequestRefused(
                "unsupported_field", f"{where}.type", f"only message items are supported, got {item.type!r}"
            )
        if item.role is None:
            raise RequestRefused("invalid_request", f"{where}.role", "a message needs a role")
        if isinstance(item.content, str):
            content = item.content
        elif item.content:
            texts = []
            for part_position, part in enumerate(item.content):
                if part.type not in _TEXT_PARTS or part.text is None:
                    raise RequestRefused(
                        "unsupported_field",
                        f"{where}.content.{part_position}",
                        f"only input_text parts are supported, got {part.type!r}",
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        else:
            raise RequestRefused("invalid_request", f"{where}.content", "a message needs content")
        messages.append({"role": item.role, "content": content})
    chat: dict[str, Any] = {"messages": messages}
    for source, target in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature")):
        if (value := getattr(request, source)) is not None:
            chat[target] = value
    if request.top_p is not None:
        chat["top_p"] = request.top_p
    text_format = request.text.format if request.text is not None else None
    if isinstance(text_format, TextFormatJsonSchema):
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": text_format.name, "schema": text_format.schema_, "strict": text_format.strict},
        }
    elif isinstance(text_format, TextFormatJsonObject):
        chat["response_format"] = {"type": "json_object"}
    return chat


class ResponsesRequests:
    """The handler of the `responses` kind: each item one chat request of the engine."""

    def __init__(self, llm: Any, model_config: BatchCompletionsModelConfig) -> None:
        self.chat = ChatRequests(llm, model_config)
        self.model_name = self.chat.model_name

    def submit(self, engine: Any, item: WorkItem) -> list[str]:
        request = ResponsesRequest.model_validate(item.request)
        _refuse_unsupported(request)
        try:
            return self.chat.submit(engine, replace(item, kind=CHAT.name, request=chat_request(request)))
        except RequestRefused as refused:  # the chat request's field, named as this request has it
            why = str(refused).removeprefix(f"{refused.param}: ") if refused.param else str(refused)
            raise RequestRefused(refused.code, _responses_field(refused.param), why) from None

    def output(self, item: WorkItem, results: list[Any]) -> dict[str, Any]:
        request = ResponsesRequest.model_validate(item.request)
        (result,) = results
        (choice,) = result.outputs
        input_tokens = len(result.prompt_token_ids or [])
        output_tokens = len(choice.token_ids)
        cut = choice.finish_reason == "length"
        suffix = f"{self.chat.id_token}-{item.index}"  # the index last: copies' ids are made from it
        text_format = request.text.format if request.text is not None and request.text.format else None
        # No `error` key, not even null as OpenAI writes it: an output holding one is an error entry to the
        # worker's counts and the merge (the SDK's Response reads its absence as null).
        return {
            "id": f"resp_{suffix}",
            "object": "response",
            "created_at": int(time.time()),
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "model": self.model_name,
            "instructions": request.instructions,
            "output": [
                {
                    "type": "message",
                    "id": f"msg_{suffix}",
                    "status": "incomplete" if cut else "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": choice.text, "annotations": []}],
                }
            ],
            "usage": {
                "input_tokens": input_tokens,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": input_tokens + output_tokens,
            },
            "parallel_tool_calls": False,
            "tool_choice": request.tool_choice or "auto",
            "tools": [],
            "text": {"format": text_format.model_dump(by_alias=True) if text_format else {"type": "text"}},
            "metadata": request.metadata or {},
            "temperature": request.temperature,
            "top_p": request.top_p,
            "max_output_tokens": request.max_output_tokens,
            "previous_response_id": None,
            "store": bool(request.store),
            "user": request.user,
        }


# The chat request's fields a refusal may name, as the responses request names them.
_CHAT_TO_RESPONSES = {
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
    "chat_template": "input",
}


def _responses_field(param: str | None) -> str | None:
    if param is None:
        return None
    return _CHAT_TO_RESPONSES.get(param.partition(".")[0], param)
