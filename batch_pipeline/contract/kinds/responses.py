"""OpenAI Responses API requests (`input`, `instructions`), the lines of `/v1/responses` batches. The worker
runs them as chat requests (instructions and input as the conversation, through the model's chat template)
with `worker/responses_requests.py`; the output is an OpenAI `response` object.

Fields the request may carry that a batch cannot honour (tools that call out, a stored conversation,
background mode, streaming, reasoning) are accepted here and refused per line by the worker, naming the
field, as the chat kind refuses its own.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import Field, computed_field

from batch_pipeline.contract.base import WireModel
from batch_pipeline.contract.kinds.base import RequestKind, WorkRequest, estimated_tokens

ENDPOINT = "/v1/responses"
# The output a request that sets no limit is planned for (the engine may fill the context).
UNBOUNDED_OUTPUT_ESTIMATE = 256
# The bound of one request's input items (OpenAI sets none it documents; a line is a conversation, not a corpus).
MAX_INPUT_ITEMS = 2048


class InputContentPart(WireModel):
    """A part of a message's content: `input_text` (and `output_text`, an earlier assistant turn as the
    API returned it) is honoured; other types (`input_image`, `input_file`, ...) are refused per line."""

    text_fields = frozenset({"text"})

    type: str = Field(max_length=64)
    text: str | None = None


class InputItem(WireModel):
    """An item of `input`: a message (`type` "message", or unset as OpenAI's easy input messages leave it).
    Other items (`function_call_output`, `reasoning`, `item_reference`, ...) are refused per line."""

    text_fields = frozenset({"content"})

    type: str = Field("message", max_length=64)
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[InputContentPart] | None = None


class TextFormatText(WireModel):
    type: Literal["text"]


class TextFormatJsonSchema(WireModel):
    """A JSON schema the output follows, through vLLM's structured outputs (as the chat kind's
    `response_format` json_schema)."""

    type: Literal["json_schema"]
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    # `schema` shadows a BaseModel attribute, hence the alias.
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class TextFormatJsonObject(WireModel):
    type: Literal["json_object"]


TextFormat = Annotated[TextFormatText | TextFormatJsonSchema | TextFormatJsonObject, Field(discriminator="type")]


class TextConfig(WireModel):
    format: TextFormat | None = None


InputText = Annotated[str, Field(min_length=1)]
InputItems = Annotated[list[InputItem], Field(min_length=1, max_length=MAX_INPUT_ITEMS)]


class ResponsesRequest(WireModel):
    """The body of OpenAI's `POST /v1/responses`."""

    text_fields = frozenset({"input", "instructions"})

    model: str | None = Field(None, description="The model; a batch's lines all name the same one")
    input: InputText | InputItems = Field(
        description="The conversation: a string (one user message), or a list of messages"
    )
    instructions: str | None = Field(None, description="A system message before the input")
    max_output_tokens: int | None = Field(None, ge=1, description="The most tokens the output may have")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    text: TextConfig | None = Field(None, description="`format`: plain text, or a JSON schema the output follows")
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16, description="Echoed in the response"
    )
    user: str | None = Field(None, max_length=256, description="The end user, as OpenAI takes it; not used")
    store: bool | None = Field(None, description="Accepted; a batch's responses are stored in its output file only")
    # Accepted to be refused per line by the worker, naming the field (never silently dropped).
    tools: list[Any] | None = None
    tool_choice: Any = None
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None
    stream: bool | None = None
    include: list[Any] | None = None
    reasoning: Any = None

    # What tells a stored record of this kind from an embeddings one, whose `input` may be a string too: the
    # job's content holds each body as dumped here (openai_batch/jobs.py), and the registry recognizes it by
    # this (contract/kinds/__init__.py).
    @computed_field  # type: ignore[prop-decorator]
    @property
    def endpoint(self) -> str:
        return ENDPOINT

    def items(self) -> list[InputItem]:
        """The input as a list of items: a string is one user message."""
        if isinstance(self.input, str):
            return [InputItem(role="user", content=self.input)]
        return list(self.input)


class ResponsesKind(RequestKind):
    name = "responses"
    wire_model = ResponsesRequest
    prompt_field = "input"
    described = "`input` with `endpoint` /v1/responses (responses)"
    openai_url = ENDPOINT
    output_limit_fields = ("max_output_tokens",)
    usage_names = ("input_tokens", "output_tokens")

    def recognizes(self, record: dict[str, Any]) -> bool:
        return record.get("endpoint") == ENDPOINT and "input" in record

    def work_requests(self, record: Any) -> Iterator[WorkRequest]:
        tokens = estimated_tokens(record.instructions or "") if record.instructions else 0
        for item in record.items():
            if isinstance(item.content, str):
                tokens += estimated_tokens(item.content)
            else:
                tokens += sum(estimated_tokens(part.text or "") for part in item.content or [])
        yield WorkRequest(record.model_dump(exclude_none=True, by_alias=True), [tokens])

    def expected_output_tokens(self, request: dict[str, Any]) -> int:
        return int(request.get("max_output_tokens") or UNBOUNDED_OUTPUT_ESTIMATE)

    def shared_context(self, request: dict[str, Any]) -> str:
        """The instructions and the conversation before its last item."""
        items = request["input"]
        before = items[:-1] if isinstance(items, list) and len(items) > 1 else []
        return json.dumps([request.get("instructions"), before])


RESPONSES = ResponsesKind()
