"""Error entries in OpenAI's error shape (`message`, `type`, `param`, `code`): the type each code takes,
and how the worker reads what the engine raised. (Real jobs' entries: test_v2_content_e2e.)"""

import pytest
from vllm.exceptions import VLLMValidationError

from batch_pipeline.contract import ErrorDetail, ErrorOutput
from batch_pipeline.worker.handlers import engine_error_output


def test_an_entry_built_from_a_code_and_a_message_takes_openais_shape():
    # As keep_partial_results builds the entries of requests a stopped job never ran.
    entry = ErrorOutput(error=ErrorDetail(code="cancelled", message="the job was cancelled")).model_dump()
    assert entry == {
        "error": {"message": "the job was cancelled", "type": "server_error", "param": None, "code": "cancelled"}
    }


@pytest.mark.parametrize(
    ("code", "error_type"),
    [
        ("invalid_request", "invalid_request_error"),
        ("unsupported_field", "invalid_request_error"),
        ("prompt_too_long", "invalid_request_error"),
        ("engine_error", "server_error"),
        ("job_failed", "server_error"),
        ("cancelled", "server_error"),
    ],
)
def test_the_type_follows_the_code(code, error_type):
    assert ErrorDetail(code=code, message="m").type == error_type


@pytest.mark.parametrize(("kind", "param"), [("v1", "prompts"), ("completion", "prompt"), ("chat", "messages")])
def test_a_prompt_past_the_context_blames_the_field_holding_the_prompt(kind, param):
    too_long = VLLMValidationError("The decoder prompt (length 9001) is longer than the maximum model length of 8192.")
    error = engine_error_output(too_long, kind)["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, "prompt_too_long")


def test_a_value_vllm_refuses_names_the_parameter_vllm_names():
    error = engine_error_output(VLLMValidationError("too many", parameter="logprobs", value=30), "chat")["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "logprobs", "invalid_request")


def test_an_engine_failure_is_a_server_error():
    error = engine_error_output(RuntimeError("CUDA error: an illegal memory access"), "completion")["error"]
    assert (error["type"], error["param"], error["code"]) == ("server_error", None, "engine_error")
    assert error["message"] == "RuntimeError: CUDA error: an illegal memory access"
