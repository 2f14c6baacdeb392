"""Tool calling for chat requests, through vLLM's own machinery, as its OpenAI server does it.

The parser named by `model_config.tool_call_parser` reads the model's tool-call format ("auto"); for
`tool_choice` "required" or a named function, the parser constrains the output to JSON calls with
structured outputs and reads them back. vLLM's request type carries the tool fields its parsers read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from batch_pipeline.contract import BatchCompletionsModelConfig, FilteredChatCompletionV2Request
from batch_pipeline.worker.handlers import RequestRefused
from batch_pipeline.worker.vllm_api import (
    ChatCompletionRequest,
    ParserManager,
    StructuredOutputsParams,
    ToolCall,
    make_tool_call_id,
)


@dataclass
class ToolCallPlan:
    """How one request's output is read for tool calls."""

    vllm_request: ChatCompletionRequest
    parser_cls: type
    structured_outputs: StructuredOutputsParams | None
    auto: bool


@dataclass
class ParsedMessage:
    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str | None


class ToolCalling:
    def __init__(self, tokenizer: Any, model_config: BatchCompletionsModelConfig, model_name: str) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.parser_name = model_config.tool_call_parser
        # Naming a parser is asking for auto tool choice, unless the config turns it off.
        self.auto_enabled = model_config.enable_auto_tool_choice is not False
        self._parser_cls: type | None = None
        self._parser_error: str | None = None

    def plan(self, request: FilteredChatCompletionV2Request) -> ToolCallPlan | None:
        """None when the output is plain content: no tools, or tool_choice 'none'."""
        if not request.tools:
            if request.tool_choice not in (None, "none"):
                raise RequestRefused("invalid_request", "tool_choice", "set only together with tools")
            return None
        tool_choice = request.tool_choice or "auto"
        if tool_choice == "none":
            return None
        auto = tool_choice == "auto"
        if auto and not self.auto_enabled:
            raise RequestRefused(
                "unsupported_field", "tool_choice", "'auto' needs model_config.enable_auto_tool_choice"
            )
        if isinstance(tool_choice, dict):
            named = (tool_choice.get("function") or {}).get("name")
            offered = [tool.function.name for tool in request.tools]
            if named not in offered:
                raise RequestRefused(
                    "invalid_request",
                    "tool_choice",
                    f"function {named!r} is not among the tools ({', '.join(offered)})",
                )
        parser_cls = self._parser()
        try:
            vllm_request = ChatCompletionRequest(
                model=self.model_name,
                messages=[],
                tools=[tool.model_dump(exclude_none=True) for tool in request.tools],
                tool_choice=tool_choice,
                parallel_tool_calls=request.parallel_tool_calls,
            )
        except ValueError as exc:  # vLLM's own checks of the tool fields (pydantic's errors are ValueErrors)
            raise RequestRefused("invalid_request", "tool_choice", str(exc)) from None
        adjusted = self._new_parser(parser_cls, vllm_request, request).adjust_request(vllm_request)
        return ToolCallPlan(adjusted, parser_cls, adjusted.structured_outputs, auto)

    def parse(self, plan: ToolCallPlan, request: FilteredChatCompletionV2Request, choice: Any) -> ParsedMessage:
        # Parsers keep state while reading: one per choice, as vLLM's server does.
        parser = self._new_parser(plan.parser_cls, plan.vllm_request, request)
        _, content, calls = parser.parse(
            choice.text, plan.vllm_request, enable_auto_tools=plan.auto, model_output_token_ids=choice.token_ids
        )
        tool_calls = [ToolCall(id=call.id or make_tool_call_id(), function=call).model_dump() for call in calls or []]
        # OpenAI's convention: "tool_calls" when auto chose to call, or "required" finished its calls.
        called = (plan.auto and tool_calls) or (
            plan.vllm_request.tool_choice == "required" and choice.finish_reason == "stop"
        )
        return ParsedMessage(content, tool_calls, "tool_calls" if called else choice.finish_reason)

    def _parser(self) -> type:
        if not self.parser_name:  # vLLM looks up no parser for an empty name either
            raise RequestRefused(
                "unsupported_field",
                "tools",
                "set model_config.tool_call_parser (the vLLM parser of this model's tool-call format)",
            )
        if self._parser_cls is None and self._parser_error is None:
            try:
                self._parser_cls = ParserManager.get_parser(
                    tool_parser_name=self.parser_name,
                    enable_auto_tools=self.auto_enabled,
                    model_name=self.model_name,
                    tokenizer=self.tokenizer,
                )
            except Exception as exc:  # unknown parser, or one this tokenizer cannot serve
                self._parser_error = str(exc)
        if self._parser_error is not None:
            # The job's model_config is to blame, not a field of the request.
            raise RequestRefused("invalid_request", "model_config.tool_call_parser", self._parser_error)
        if self._parser_cls is None:
            # vLLM gives no parser while auto tool choice is off, and without one no tool call can be read.
            raise RequestRefused(
                "unsupported_field", "tool_choice", "tool calls need model_config.enable_auto_tool_choice here"
            )
        return self._parser_cls

    def _new_parser(self, parser_cls: type, vllm_request: ChatCompletionRequest, request: Any) -> Any:
        return parser_cls(
            self.tokenizer, vllm_request.tools, chat_template_kwargs=request.chat_template_kwargs, model_config=None
        )


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool-use chat templates read an earlier call's arguments as a dict, where OpenAI sends a JSON
    string (vLLM's server converts them the same way)."""
    for position, message in enumerate(messages):
        for call in message.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    raise RequestRefused(
                        "invalid_request", f"messages.{position}.tool_calls", "arguments are not valid JSON"
                    ) from None
    return messages
