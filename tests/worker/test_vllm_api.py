"""The names the worker takes from vLLM still exist in the pinned version, where worker/vllm_api.py says
they are: a new vLLM that moved one fails here, naming it, rather than in a shard worker at run time. And
the worker's prompts reach a real engine as this vLLM wants them, rendered by its renderer: no deprecation."""

import functools
import importlib
import json
import logging
import multiprocessing
import unittest
import warnings
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest

from batch_pipeline.contract import BatchCompletionsModelConfig
from batch_pipeline.shards.format import WorkItem
from batch_pipeline.worker import vllm_api
from batch_pipeline.worker.handlers import engine_error_output
from tests.conftest import MODEL


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


def test_every_kind_of_the_registry_has_a_worker_handler_and_no_other_kind_does():
    from batch_pipeline.contract.kinds import KINDS
    from batch_pipeline.dry_run.counting import model_of
    from batch_pipeline.worker.embedding_requests import EmbeddingRequests
    from batch_pipeline.worker.handlers import RequestRefused
    from batch_pipeline.worker.kinds import HANDLERS, WrongRunner, kind_handlers
    from batch_pipeline.worker.openai_requests import ChatRequests, CompletionRequests
    from batch_pipeline.worker.responses_requests import ResponsesRequests
    from batch_pipeline.worker.v1_requests import V1Requests

    assert set(HANDLERS) == {kind.name for kind in KINDS}
    model_config = BatchCompletionsModelConfig(model=MODEL)
    # The model as the dry run reads it (its tokenizer and config, no weights): what a handler reads of an LLM.
    handlers = kind_handlers(model_of(model_config), model_config)
    assert {name: type(handler) for name, handler in handlers.items()} == {
        "v1": V1Requests,
        "completion": CompletionRequests,
        "chat": ChatRequests,
        "embeddings": WrongRunner,  # a generating model computes no embeddings
        "responses": ResponsesRequests,
    }
    # An embedding model: its own kind's handler, and every generating kind's items refused naming the model.
    embedding_config = BatchCompletionsModelConfig(model="all-minilm-l6-v2")
    pooling = kind_handlers(model_of(embedding_config), embedding_config)
    assert {name: type(handler) for name, handler in pooling.items()} == {
        "v1": WrongRunner,
        "completion": WrongRunner,
        "chat": WrongRunner,
        "embeddings": EmbeddingRequests,
        "responses": WrongRunner,
    }
    item = WorkItem(index=0, kind="chat", request={"messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(RequestRefused) as refused:
        pooling["chat"].submit(None, item)
    assert (refused.value.code, refused.value.param) == ("model_not_supported", "model")
    assert "'all-minilm-l6-v2' computes embeddings" in str(refused.value)
    with pytest.raises(RequestRefused, match="generates text"):
        handlers["embeddings"].submit(None, WorkItem(index=0, kind="embeddings", request={"input": "x"}))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"background": True}, "background"),
        ({"stream": True}, "stream"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "4"}]}, "input.0.type"),
        ({"input": [{"role": "user", "content": "a"}, {"type": "reasoning", "summary": []}]}, "input.1.type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
            "input.0.content.0",
        ),
        ({"input": [{"type": "message", "content": "a"}]}, "input.0.role"),
    ],
)
def test_a_responses_field_no_batch_can_honour_is_refused_for_its_line_naming_it(body, param):
    """Refused before anything reaches the engine (there is none here: the dry run's stand-in model), each
    naming its field; nothing is silently dropped."""
    from batch_pipeline.dry_run.counting import model_of
    from batch_pipeline.worker.handlers import RequestRefused
    from batch_pipeline.worker.kinds import kind_handlers

    model_config = BatchCompletionsModelConfig(model=MODEL)
    handler = kind_handlers(model_of(model_config), model_config)["responses"]
    item = WorkItem(index=0, kind="responses", request={"input": "hi", **body, "endpoint": "/v1/responses"})
    with pytest.raises(RequestRefused) as refused:
        handler.submit(None, item)
    assert refused.value.param == param and str(refused.value).startswith(f"{param}: "), str(refused.value)


def test_a_responses_request_runs_as_the_chat_request_of_its_instructions_and_input():
    from batch_pipeline.contract.kinds.responses import ResponsesRequest
    from batch_pipeline.worker.responses_requests import chat_request

    request = ResponsesRequest.model_validate(
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": "Use digits."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Two plus two?"}]},
                {"role": "assistant", "content": [{"type": "output_text", "text": "4"}]},
                {"role": "user", "content": "And three?"},
            ],
            "max_output_tokens": 9,
            "temperature": 0,
            "top_p": 0.5,
            "tool_choice": "none",
            "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "integer"}, "strict": True}},
        }
    )
    assert chat_request(request) == {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": "Use digits."},
            {"role": "user", "content": "Two plus two?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And three?"},
        ],
        "max_completion_tokens": 9,
        "temperature": 0,
        "top_p": 0.5,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "n", "schema": {"type": "integer"}, "strict": True},
        },
    }
    plain = ResponsesRequest.model_validate({"input": "hi", "text": {"format": {"type": "text"}}})
    assert chat_request(plain) == {"messages": [{"role": "user", "content": "hi"}]}


def test_the_token_counts_read_each_kinds_usage_by_the_names_its_kind_gives_them():
    from batch_pipeline.worker.checkpoint import token_counts

    assert token_counts({"usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}) == (5, 2)
    assert token_counts({"usage": {"prompt_tokens": 5, "total_tokens": 5}}) == (5, 0)  # an embedding
    responses_usage = {"input_tokens": 5, "output_tokens": 3, "total_tokens": 8, "input_tokens_details": {}}
    assert token_counts({"object": "response", "usage": responses_usage}) == (5, 3)
    assert token_counts({"num_prompt_tokens": 4, "num_completion_tokens": 1}) == (4, 1)  # v1


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        vllm_api.no_such_name  # noqa: B018


# --- A real engine: prompts added as the shard worker adds them ------------------------------------------
#
# The engine runs in a process of its own, as in a shard worker: at start vLLM rebinds kernels over every
# module loaded in its process, and trips on the Flask proxy an earlier test's S3 server (moto) leaves in
# this one. The checks run there; what they found comes back here.


@pytest.fixture(scope="module")
def engine_process():
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


@functools.cache
def _engine_and_handlers() -> tuple[Any, dict[str, Any]]:
    """In the engine's process: the built-in model's engine, built as a shard worker builds it, and the
    worker's handlers."""
    from batch_pipeline.worker.engine import build_llm, set_engine_environment
    from batch_pipeline.worker.kinds import kind_handlers

    set_engine_environment()
    built = build_llm(BatchCompletionsModelConfig(model=MODEL, max_model_len=256, dtype="float32"))
    return built, kind_handlers(built.llm, BatchCompletionsModelConfig(model=MODEL))


def _outputs_added_without_deprecation(items: list[WorkItem]) -> list[dict[str, Any]]:
    """In the engine's process: each item's output, its requests added and run to the end as the shard
    runner does; an AssertionError when vLLM warned while they were added."""
    from vllm.logger import _print_warning_once

    built, handlers = _engine_and_handlers()
    _print_warning_once.cache_clear()  # vLLM logs each deprecation once a process: whatever came before
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        with unittest.TestCase().assertNoLogs("vllm", logging.WARNING):
            submitted = {item.index: handlers[item.kind].submit(built.engine, item) for item in items}
    finished = {}
    while len(finished) < sum(map(len, submitted.values())):
        finished.update({result.request_id: result for result in built.engine.step() if result.finished})
    return [handlers[item.kind].output(item, [finished[i] for i in submitted[item.index]]) for item in items]


def _refusal(item: WorkItem) -> tuple[str, dict[str, Any], bool]:
    """In the engine's process: what adding the item raised, its error entry, and whether the engine holds
    any request afterwards."""
    built, handlers = _engine_and_handlers()
    try:
        handlers[item.kind].submit(built.engine, item)
    except Exception as exc:
        return (
            type(exc).__name__,
            engine_error_output(exc, item.kind)["error"],
            built.llm.llm_engine.has_unfinished_requests(),
        )
    raise AssertionError(f"the engine took {item}")


def _cached_tokens_one_at_a_time(turns: list[tuple[str | None, WorkItem]]) -> list[int]:
    """In the engine's process: each item added for its team, as a shard of that team adds it, and run to
    the end before the next is added; the prompt tokens each found in the prefix cache."""
    from batch_pipeline.worker.prefix_cache import SaltedEngine

    built, handlers = _engine_and_handlers()
    cached = []
    for team, item in turns:
        (request_id,) = handlers[item.kind].submit(SaltedEngine(built.engine, team), item)
        finished = None
        while finished is None:
            finished = next((r for r in built.engine.step() if r.finished and r.request_id == request_id), None)
        cached.append(finished.num_cached_tokens)
    return cached


@pytest.mark.slow
def test_one_teams_prefix_cache_never_serves_another_teams_request_in_one_engine(engine_process, tokenizer):
    """vLLM's prefix cache, salted per team (worker/prefix_cache.py): a team's second request with a long
    prefix reads it from the cache; another team's identical request computes it again, as does the
    first request of that team, whose own second then hits."""
    prefix = "You are a careful assistant who answers in one word. " * 10
    assert len(tokenizer.encode(prefix)) > 3 * 32  # several whole KV blocks (32 tokens on the CPU) shared

    def item(index: int, question: str) -> WorkItem:
        return WorkItem(index, "completion", {"prompt": prefix + question, "max_tokens": 2, "temperature": 0})

    turns = [
        ("team-a", item(100, "Q: sky colour? A:")),
        ("team-a", item(101, "Q: grass colour? A:")),
        ("team-b", item(102, "Q: grass colour? A:")),  # the same prompt as team-a's second
        ("team-b", item(103, "Q: snow colour? A:")),
    ]
    a_first, a_second, b_first, b_second = engine_process.submit(_cached_tokens_one_at_a_time, turns).result()
    assert a_first == 0 and b_first == 0, (a_first, b_first)
    assert a_second >= 3 * 32 and b_second >= 3 * 32, (a_second, b_second)


@pytest.mark.slow
def test_every_kind_of_prompt_reaches_the_engine_rendered_with_no_deprecation(engine_process, tokenizer):
    token_ids = tokenizer.encode("Hello there")
    say_ok = [{"role": "user", "content": "Say OK."}]
    items = [
        WorkItem(0, "v1", {"prompt": "Once upon a time", "max_new_tokens": 4, "temperature": 0.0}),
        WorkItem(1, "completion", {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}),
        WorkItem(2, "completion", {"prompt": token_ids, "max_tokens": 4, "temperature": 0}),
        WorkItem(3, "chat", {"messages": say_ok, "max_tokens": 4, "temperature": 0}),
    ]
    v1, text, tokens, chat = engine_process.submit(_outputs_added_without_deprecation, items).result()
    assert v1["num_prompt_tokens"] == len(tokenizer.encode("Once upon a time")) and v1["num_completion_tokens"] == 4
    assert text["usage"]["prompt_tokens"] == v1["num_prompt_tokens"] and text["choices"][0]["text"] == v1["text"]
    assert tokens["usage"]["prompt_tokens"] == len(token_ids)
    # The chat template writes the special tokens; none is added to them.
    templated = tokenizer.apply_chat_template(say_ok, add_generation_prompt=True, return_dict=True)
    assert chat["usage"]["prompt_tokens"] == len(templated["input_ids"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        ("v1", {"prompt": "word " * 400, "max_new_tokens": 4, "temperature": 0.0}, "prompts"),
        ("completion", {"prompt": "word " * 400, "max_tokens": 4}, "prompt"),
        ("completion", {"prompt": [100] * 300, "max_tokens": 4}, "prompt"),
        ("chat", {"messages": [{"role": "user", "content": "word " * 400}], "max_tokens": 4}, "messages"),
    ],
)
def test_a_prompt_past_the_context_is_refused_naming_its_field(engine_process, kind, body, param):
    raised, error, unfinished = engine_process.submit(_refusal, WorkItem(0, kind, body)).result()
    assert raised == "VLLMValidationError"
    assert (error["code"], error["param"]) == ("prompt_too_long", param), error
    assert not unfinished


@pytest.mark.slow
def test_responses_lines_on_a_real_engine_are_responses_the_openai_sdk_parses(engine_process, tokenizer):
    """A plain request cut by its limit, and one whose text.format is a JSON schema: each output is the SDK's
    `Response`, its usage the engine's tokens, the schema's output JSON that matches it."""
    from openai.types.responses import Response

    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    responses = {"endpoint": "/v1/responses"}
    items = [
        WorkItem(
            0,
            "responses",
            {
                **responses,
                "instructions": "Be brief.",
                "input": "Count to ten.",
                "max_output_tokens": 3,
                "temperature": 0,
                "metadata": {"k": "v"},
            },
        ),
        WorkItem(
            1,
            "responses",
            {
                **responses,
                "input": [{"role": "user", "content": [{"type": "input_text", "text": "What is 2+2? Reply in JSON."}]}],
                "max_output_tokens": 24,
                "temperature": 0,
                "text": {"format": {"type": "json_schema", "name": "sum", "schema": schema, "strict": True}},
            },
        ),
    ]
    cut, structured = engine_process.submit(_outputs_added_without_deprecation, items).result()
    # An output with an `error` key is an error entry to the worker's counts and the merge: a response has none.
    assert "error" not in cut and "error" not in structured
    parsed_cut = Response.model_validate(cut)
    assert parsed_cut.status == "incomplete" and parsed_cut.incomplete_details.reason == "max_output_tokens"
    assert parsed_cut.usage.output_tokens == 3 and parsed_cut.metadata == {"k": "v"}
    templated = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to ten."}],
        add_generation_prompt=True,
        return_dict=True,
    )
    assert parsed_cut.usage.input_tokens == len(templated["input_ids"])
    assert parsed_cut.usage.total_tokens == parsed_cut.usage.input_tokens + 3
    parsed = Response.model_validate(structured)
    assert parsed.status == "completed" and parsed.output[0].type == "message"
    answer = json.loads(parsed.output_text)
    assert set(answer) == {"answer"} and isinstance(answer["answer"], int), parsed.output_text
    assert parsed.text.format.type == "json_schema"
    # The merge's and the usage report's token counts read a responses usage by its own names.
    from batch_pipeline.worker.checkpoint import token_counts

    assert token_counts(structured) == (parsed.usage.input_tokens, parsed.usage.output_tokens)


@pytest.mark.slow
def test_a_responses_schema_that_never_terminates_ends_at_the_context_or_fails_its_line_naming_text_format(
    engine_process,
):
    """A JSON schema no output within the context can satisfy (an array of at least 100,000 integers), with
    no max_output_tokens: its line ends, incomplete, where the context does, or fails alone naming
    `text.format`; the shard is never stuck on it, and the line after it is answered."""
    from openai.types.responses import Response

    endless = {"type": "array", "items": {"type": "integer"}, "minItems": 100_000}
    responses = {"endpoint": "/v1/responses", "temperature": 0}
    items = [
        WorkItem(
            0,
            "responses",
            {
                **responses,
                "input": "List numbers as JSON.",
                "text": {"format": {"type": "json_schema", "name": "endless", "schema": endless}},
            },
        ),
        WorkItem(1, "responses", {**responses, "input": "Say hello.", "max_output_tokens": 3}),
    ]
    endless_output, after = engine_process.submit(_outputs_added_without_deprecation, items).result(timeout=600)
    if "error" in endless_output:
        assert endless_output["error"]["param"].startswith("text.format"), endless_output
    else:
        parsed = Response.model_validate(endless_output)
        assert parsed.status == "incomplete", parsed
    assert Response.model_validate(after).usage.output_tokens == 3
