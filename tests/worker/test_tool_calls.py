"""Tool calling refusals: a chat request whose tools cannot be served here fails alone, naming the field
to change. (Served tool calls run end to end in test_v2_content_e2e.)"""

import pytest

from batch_pipeline.contract import BatchCompletionsModelConfig, FilteredChatCompletionV2Request
from tests.conftest import MODEL

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def _plan(tokenizer, model_config: dict, **request):
    from batch_pipeline.worker.tool_calls import ToolCalling

    calling = ToolCalling(
        tokenizer, BatchCompletionsModelConfig.model_validate({"model": MODEL, **model_config}), MODEL
    )
    chat = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], **request}
    return calling.plan(FilteredChatCompletionV2Request.model_validate(chat))


@pytest.mark.parametrize(
    ("model_config", "request_fields", "field"),
    [
        ({}, {"tools": [WEATHER]}, "tools: set model_config.tool_call_parser"),
        ({"tool_call_parser": "no_such_parser"}, {"tools": [WEATHER]}, "model_config.tool_call_parser:"),
        # this parser needs a special token SmolLM2's tokenizer lacks
        ({"tool_call_parser": "llama3_json"}, {"tools": [WEATHER]}, "model_config.tool_call_parser:"),
        (
            {"tool_call_parser": "pythonic", "enable_auto_tool_choice": False},
            {"tools": [WEATHER]},
            "tool_choice: 'auto' needs model_config.enable_auto_tool_choice",
        ),
        ({"tool_call_parser": "pythonic"}, {"tool_choice": "required"}, "tool_choice: set only together with tools"),
        # vLLM looks up no parser while auto tool choice is off: this was a server error ('NoneType' is not
        # callable) for every such request
        (
            {"tool_call_parser": "pythonic", "enable_auto_tool_choice": False},
            {"tools": [WEATHER], "tool_choice": "required"},
            "tool_choice: tool calls need model_config.enable_auto_tool_choice",
        ),
        ({"tool_call_parser": ""}, {"tools": [WEATHER]}, "tools: set model_config.tool_call_parser"),
    ],
)
def test_tools_that_cannot_be_served_are_refused_naming_the_field(tokenizer, model_config, request_fields, field):
    from batch_pipeline.worker.handlers import RequestRefused

    with pytest.raises(RequestRefused) as refused:
        _plan(tokenizer, model_config, **request_fields)
    assert str(refused.value).startswith(field)
    assert refused.value.param == field.partition(":")[0]  # the error entry's `param`


def test_tool_choice_none_and_no_tools_need_no_parser(tokenizer):
    assert _plan(tokenizer, {}, tools=[WEATHER], tool_choice="none") is None
    assert _plan(tokenizer, {}) is None


def test_required_tool_choice_constrains_the_output_to_calls_of_the_given_tools(tokenizer):
    plan = _plan(
        tokenizer, {"tool_call_parser": "pythonic"}, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False
    )
    schema = plan.structured_outputs.json
    assert schema["type"] == "array" and schema["maxItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["get_weather"]
