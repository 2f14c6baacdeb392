"""The names the worker takes from vLLM still exist in the pinned version, where worker/vllm_api.py says
they are: a new vLLM that moved one fails here, naming it, rather than in a shard worker at run time."""

import importlib

import pytest

from batch_pipeline.worker import vllm_api


@pytest.mark.parametrize("name", sorted(vllm_api.MODULES))
def test_each_name_taken_from_vllm_is_where_the_adapter_says(name):
    module = importlib.import_module(vllm_api.MODULES[name])
    assert hasattr(module, name), f"vllm has no {vllm_api.MODULES[name]}.{name}: update worker/vllm_api.py"
    assert getattr(vllm_api, name) is getattr(module, name)


def test_the_openai_request_defaults_the_worker_falls_back_to_are_readable():
    for request_type in (vllm_api.ChatCompletionRequest, vllm_api.CompletionRequest):
        defaults = vllm_api.openai_sampling_defaults(request_type)
        assert {"temperature", "top_p", "top_k", "repetition_penalty"} <= set(defaults), defaults
        assert defaults["temperature"] == 1.0 and defaults["top_p"] == 1.0


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        vllm_api.no_such_name  # noqa: B018
