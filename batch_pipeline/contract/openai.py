"""OpenAI-style completion and chat requests: the list forms of v2 `content`.

Fields follow vLLM's OpenAI server (`FilteredCompletionV2Request` / `FilteredChatCompletionV2Request` in the
spec). Bounds are OpenAI's. Whether a field can be honoured for a given model is the worker's call: it
answers with an error entry at that request's index, naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from batch_pipeline.contract.base import WireModel

TokenIds = list[int]


class ResponseFormatText(WireModel):
    type: Literal["text"]


class JsonSchema(WireModel):
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    # `schema` shadows a BaseModel attribute, hence the alias.
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormatJsonSchema(WireModel):
    type: Literal["json_schema"]
    json_schema: JsonSchema


class ResponseFormatJsonObject(WireModel):
    type: Literal["json_object"]


ResponseFormat = ResponseFormatText | ResponseFormatJsonSchema | ResponseFormatJsonObject


class StreamOptions(WireModel):
    include_usage: bool | None = None


class _VllmSamplingExtras(WireModel):
    """Sampling fields vLLM adds to OpenAI's, shared by completion and chat requests."""

    best_of: int | None = Field(None, ge=1, le=20)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    repetition_penalty: float | None = Field(None, gt=0.0)
    early_stopping: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0)
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    guided_json: dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None


class _OpenAISampling(WireModel):
    model: str | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = Field(None, ge=0)
    n: int | None = Field(None, ge=1, le=128)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    user: str | None = None


class FilteredCompletionV2Request(_VllmSamplingExtras, _OpenAISampling):
    """One OpenAI-style completion request."""

    text_fields = frozenset({"prompt", "suffix", "stop"})

    prompt: str | list[str] | TokenIds | list[TokenIds]
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None
    add_special_tokens: bool | None = None
    response_format: ResponseFormat | None = Field(None, discriminator="type")


class ContentPartText(WireModel):
    text_fields = frozenset({"text"})

    type: Literal["text"]
    text: str


class ChatMessage(WireModel):
    """One message of a conversation. Content is text or a list of content parts; parts other than text
    (images, audio, files) are accepted here and refused per request by the worker, which names them."""

    text_fields = frozenset({"content"})

    role: Literal["developer", "system", "user", "assistant", "tool", "function"]
    content: str | list[ContentPartText | dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    function_call: dict[str, Any] | None = None
    refusal: str | None = None
    audio: dict[str, Any] | None = None


class FunctionObject(WireModel):
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionTool(WireModel):
    type: Literal["function"]
    function: FunctionObject


class FilteredChatCompletionV2Request(_VllmSamplingExtras, _OpenAISampling):
    """One OpenAI-style chat completion request."""

    messages: list[ChatMessage] = Field(min_length=1)
    echo: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    priority: int | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex"] | None = None
    modalities: list[str] | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    max_completion_tokens: int | None = Field(None, ge=0)
    web_search_options: dict[str, Any] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = Field(None, discriminator="type")
    audio: dict[str, Any] | None = None
    store: bool | None = None
    logprobs: bool | None = None
    prediction: dict[str, Any] | None = None
    tools: list[ChatCompletionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    function_call: Literal["none", "auto"] | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
