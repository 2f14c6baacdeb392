"""The wire contract against the spec: the v1 JSON Schema, every bound at and past its edge, the input rule."""

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from batch_pipeline.contract import (
    BatchCompletionsJob,
    CreateBatchCompletionsV1Request,
    CreateBatchCompletionsV1RequestContent,
    CreateBatchCompletionsV2Request,
    FilteredChatCompletionV2Request,
    FilteredCompletionV2Request,
)
from batch_pipeline.contract.kinds.embedding import EmbeddingRequest
from batch_pipeline.contract.kinds.responses import ResponsesRequest

SPEC_V1_SCHEMA = json.loads(
    (Path(__file__).resolve().parents[1] / "fixtures" / "spec_002_v1_request.schema.json").read_text()
)
BOUND_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _shape(schema: dict) -> dict:
    """What matters of a property schema: its types, refs, bounds, enum and default."""
    variants = schema.get("anyOf", [schema])
    return {
        "types": sorted(v.get("type", "") for v in variants if "type" in v),
        "refs": sorted(v["$ref"].rsplit("/", 1)[-1] for v in variants if "$ref" in v),
        "items": sorted(json.dumps(v.get("items"), sort_keys=True) for v in variants if "items" in v),
        "bounds": sorted((k, float(v[k])) for v in variants for k in BOUND_KEYWORDS if k in v),
        "enum": schema.get("enum"),
        "default": schema.get("default"),
    }


def _compare_object(ours: dict, spec: dict, where: str) -> list[str]:
    problems = []
    if set(ours.get("properties", {})) != set(spec.get("properties", {})):
        problems.append(f"{where}: properties differ: {set(ours['properties']) ^ set(spec['properties'])}")
    if sorted(ours.get("required", [])) != sorted(spec.get("required", [])):
        problems.append(f"{where}: required {ours.get('required')} != {spec.get('required')}")
    for name, spec_property in spec.get("properties", {}).items():
        if name in ours.get("properties", {}):
            mine, theirs = _shape(ours["properties"][name]), _shape(spec_property)
            if mine != theirs:
                problems.append(f"{where}.{name}: {mine} != {theirs}")
    return problems


def test_v1_json_schema_matches_the_spec():
    ours = CreateBatchCompletionsV1Request.model_json_schema(by_alias=True)
    problems = _compare_object(ours, SPEC_V1_SCHEMA, "CreateBatchCompletionsV1Request")
    assert set(ours["$defs"]) == set(SPEC_V1_SCHEMA["$defs"])
    for name, spec_def in SPEC_V1_SCHEMA["$defs"].items():
        if spec_def.get("type") == "object":
            problems += _compare_object(ours["$defs"][name], spec_def, name)
        else:
            assert ours["$defs"][name]["enum"] == spec_def["enum"], name
    assert problems == []


def _v1(**overrides):
    body = {
        "output_data_path": "/tmp/out.json",
        "model_config": {"model": "smollm2-135m-instruct"},
        "content": {"prompts": ["hi"], "max_new_tokens": 4, "temperature": 0.5},
    }
    for dotted, value in overrides.items():
        target = body
        *parents, leaf = dotted.split("__")
        for key in parents:
            target = target[key]
        target[leaf] = value
    return body


# (field path as written in an override, value at the edge that is accepted, value just past it)
BOUNDS = [
    ("data_parallelism", 1, 0),
    ("data_parallelism", 64, 65),
    ("max_runtime_sec", 1, 0),
    ("max_runtime_sec", 172800, 172801),
    ("content__temperature", 0.0, -0.01),
    ("content__temperature", 1.0, 1.01),
    ("content__presence_penalty", 0.0, -0.1),
    ("content__presence_penalty", 2.0, 2.1),
    ("content__frequency_penalty", 0.0, -0.1),
    ("content__frequency_penalty", 2.0, 2.1),
    ("content__top_k", -1, -2),
    ("content__top_p", 1.0, 1.01),
    ("content__top_p", 1e-9, 0.0),
    ("model_config__num_shards", 1, 0),
    ("model_config__max_context_length", 1, 0),
]


@pytest.mark.parametrize("request_type", [CreateBatchCompletionsV1Request, CreateBatchCompletionsV2Request])
@pytest.mark.parametrize(("field", "edge", "past"), BOUNDS)
def test_bounds_accept_the_edge_and_reject_past_it_naming_the_field(request_type, field, edge, past):
    request_type.model_validate(_v1(**{field: edge}))
    with pytest.raises(ValidationError) as caught:
        request_type.model_validate(_v1(**{field: past}))
    # v2 content is a tagged union: the path names the shape it was read as (content.v1.temperature).
    locations = [".".join(str(p) for p in error["loc"] if p != "v1") for error in caught.value.errors()]
    assert field.replace("__", ".") in locations


def test_defaults_are_the_specs():
    request = CreateBatchCompletionsV1Request.model_validate(_v1())
    assert request.data_parallelism == 1
    assert request.max_runtime_sec == 86400
    assert request.labels == {}
    assert request.priority is None
    assert request.model_cfg.trust_remote_code is False
    assert request.model_cfg.num_shards == 1
    assert request.content.return_token_log_probs is False
    assert request.content.skip_special_tokens is True
    with_tool = CreateBatchCompletionsV1Request.model_validate(_v1(tool_config={"name": "code_evaluator"}))
    assert (with_tool.tool_config.max_iterations, with_tool.tool_config.execution_timeout_seconds) == (10, 60)
    assert with_tool.tool_config.should_retry_on_error is True


@pytest.mark.parametrize("request_type", [CreateBatchCompletionsV1Request, CreateBatchCompletionsV2Request])
def test_exactly_one_of_input_data_path_and_content(request_type):
    neither = _v1()
    del neither["content"]
    with pytest.raises(ValidationError, match="Either input_data_path or content"):
        request_type.model_validate(neither)
    both = _v1(input_data_path="/tmp/in.json")
    with pytest.raises(ValidationError, match="Only one of input_data_path and content"):
        request_type.model_validate(both)
    only_path = _v1(input_data_path="/tmp/in.json")
    del only_path["content"]
    assert request_type.model_validate(only_path).input_data_path == "/tmp/in.json"


def test_required_fields_are_named_when_missing():
    body = _v1()
    del body["content"]["max_new_tokens"]
    del body["model_config"]["model"]
    with pytest.raises(ValidationError) as caught:
        CreateBatchCompletionsV1Request.model_validate(body)
    locations = {".".join(str(part) for part in error["loc"]) for error in caught.value.errors()}
    assert {"content.max_new_tokens", "model_config.model"} <= locations


def test_unknown_fields_are_ignored_like_the_reference_server():
    request = CreateBatchCompletionsV1Request.model_validate(_v1(some_future_field=1, content__new_knob=True))
    assert "some_future_field" not in request.model_dump()


def test_model_config_round_trips_under_its_wire_name():
    request = CreateBatchCompletionsV2Request.model_validate(_v1(model_config__max_model_len=2048))
    dumped = request.model_dump(by_alias=True, exclude_none=True)
    assert dumped["model_config"]["max_model_len"] == 2048
    assert CreateBatchCompletionsV2Request.model_validate(dumped) == request


def test_gpu_type_must_be_one_of_the_spec():
    CreateBatchCompletionsV1Request.model_validate(_v1(gpu_type="nvidia-hopper-h100"))
    with pytest.raises(ValidationError) as caught:
        CreateBatchCompletionsV1Request.model_validate(_v1(gpu_type="nvidia-rtx-4090"))
    assert caught.value.errors()[0]["loc"] == ("gpu_type",)


def test_max_new_tokens_below_one_is_refused():
    with pytest.raises(ValidationError) as caught:
        CreateBatchCompletionsV1RequestContent.model_validate({"prompts": ["a"], "max_new_tokens": 0, "temperature": 0})
    assert caught.value.errors()[0]["loc"] == ("max_new_tokens",)


def test_v2_content_takes_each_of_its_three_shapes():
    v1_content = CreateBatchCompletionsV2Request.model_validate(_v1())
    assert isinstance(v1_content.content, CreateBatchCompletionsV1RequestContent)
    completions = CreateBatchCompletionsV2Request.model_validate(
        _v1(content=[{"prompt": "Say hi", "max_tokens": 5}, {"prompt": [1, 2, 3]}])
    )
    assert all(isinstance(item, FilteredCompletionV2Request) for item in completions.content)
    chats = CreateBatchCompletionsV2Request.model_validate(
        _v1(content=[{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}])
    )
    assert isinstance(chats.content[0], FilteredChatCompletionV2Request)


def test_v2_list_content_errors_name_the_element_and_field():
    with pytest.raises(ValidationError) as caught:
        CreateBatchCompletionsV2Request.model_validate(
            _v1(content=[{"prompt": "fine"}, {"prompt": "bad", "temperature": 3.0}])
        )
    locations = [".".join(str(part) for part in error["loc"]) for error in caught.value.errors()]
    assert locations == ["content.1.temperature"]  # the wire's path, not the parser's `content.completion.1...`


@pytest.mark.parametrize(
    "content, named, at",
    [
        (
            [{"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "a"}, {"prompt": "b"}],
            "request 1 is a completion",
            1,
        ),
        (
            [{"prompt": "a"}, {"prompt": "b"}, {"messages": [{"role": "user", "content": "hi"}]}],
            "request 2 is a chat",
            2,
        ),
    ],
)
def test_a_list_mixing_chat_and_completion_requests_is_named_for_what_it_is(content, named, at):
    with pytest.raises(ValidationError) as caught:
        CreateBatchCompletionsV2Request.model_validate(_v1(content=content))
    (error,) = caught.value.errors()
    assert error["loc"] == ("content", at) and named in error["msg"] and "send two jobs" in error["msg"]


def test_job_serialises_with_the_spec_field_names():
    job = BatchCompletionsJob.model_validate(
        {
            "job_id": "j1",
            "output_data_path": "/tmp/o.json",
            "model_config": {"model": "m"},
            "status": "queued",
            "created_at": "2026-01-01T00:00:00Z",
            "expires_at": "2026-01-02T00:00:00Z",
            "completed_at": None,
            "metadata": None,
        }
    )
    dumped = job.model_dump(mode="json", by_alias=True)
    assert dumped["model_config"]["model"] == "m" and dumped["status"] == "queued"
    assert {"completed_at", "metadata", "priority", "input_data_path"} <= set(dumped)


def test_every_status_the_store_holds_is_a_status_the_wire_reports():
    """The contract cannot import the store, so this keeps the two enums one list: a status added to the
    store but not to the wire would make every GET of such a job fail its response model."""
    from batch_pipeline.contract import BatchCompletionsJobStatus
    from batch_pipeline.store.schema import JobStatus

    assert {status.value for status in JobStatus} == {status.value for status in BatchCompletionsJobStatus} - {
        "unknown"
    }


# --- The registry of request kinds ------------------------------------------------------------------------


def test_the_registry_lists_each_kind_once_with_what_every_layer_asks_of_it():
    from batch_pipeline.contract.kinds import _RECOGNIZED_FIRST, KINDS, RequestKind, kind_named

    names = [kind.name for kind in KINDS]
    assert names == ["v1", "completion", "chat", "embeddings", "responses"] and len(set(names)) == len(names)
    assert sorted(_RECOGNIZED_FIRST, key=KINDS.index) == list(KINDS)  # every kind recognized, none twice
    for kind in KINDS:
        assert isinstance(kind, RequestKind) and kind_named(kind.name) is kind
        assert kind.prompt_field in kind.wire_model.model_fields, kind
        assert set(kind.output_limit_fields) <= set(kind.wire_model.model_fields), kind
        for method in ("work_requests", "expected_output_tokens", "shared_context"):
            assert getattr(type(kind), method) is not getattr(RequestKind, method), f"{kind} lacks {method}"


@pytest.mark.parametrize(
    "record, kind",
    [
        ({"prompts": ["a"], "max_new_tokens": 1, "temperature": 0}, "v1"),
        ({"prompt": "a"}, "completion"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "chat"),
        # unknown fields are ignored, so a record holding several kinds' prompt fields is the most specific's
        ({"messages": [{"role": "user", "content": "hi"}], "prompt": "a", "prompts": ["b"]}, "chat"),
        ({"prompts": ["a"], "prompt": "b", "max_new_tokens": 1, "temperature": 0}, "v1"),
        ({"input": ["a", "b"], "encoding_format": "base64"}, "embeddings"),
        ({"input": "a", "prompt": "b"}, "completion"),
        # a responses body as the job's content holds it says so: its string `input` is an embedding's too
        ({"input": "a", "endpoint": "/v1/responses"}, "responses"),
        ({"input": [{"role": "user", "content": "a"}], "endpoint": "/v1/responses", "prompt": "b"}, "responses"),
        ({"input": "a", "endpoint": "/v1/embeddings"}, "embeddings"),
    ],
)
def test_a_record_is_the_kind_whose_prompt_field_it_holds(record, kind):
    from batch_pipeline.contract.records import parse_record

    parsed_kind, parsed = parse_record(record, "line 1")
    assert parsed_kind == kind
    assert isinstance(
        parsed,
        {
            "v1": CreateBatchCompletionsV1RequestContent,
            "completion": FilteredCompletionV2Request,
            "chat": FilteredChatCompletionV2Request,
            "embeddings": EmbeddingRequest,
            "responses": ResponsesRequest,
        }[kind],
    )


@pytest.mark.parametrize(
    "given, inputs",
    [
        ("one", ["one"]),
        (["one", "two"], ["one", "two"]),
        ([101, 102], [[101, 102]]),
        ([[101], [102, 103]], [[101], [102, 103]]),
    ],
)
def test_an_embedding_request_is_one_work_item_weighed_by_each_input_and_computed_once_if_repeated(given, inputs):
    from batch_pipeline.contract.kinds import EMBEDDING
    from batch_pipeline.shards.format import WorkItem
    from batch_pipeline.shards.records import repeat_key, work_items

    request = EmbeddingRequest.model_validate({"input": given})
    assert request.inputs() == inputs
    [(item, size)] = list(work_items([("line 1", {"input": given})]))
    assert item.kind == EMBEDDING.name and size.prompts == len(inputs)
    assert EMBEDDING.expected_output_tokens(item.request) == 0  # a vector: no output tokens planned
    # Embeddings are deterministic: two equal lines share one computation (the shard's copies).
    again = WorkItem(index=1, kind=item.kind, request=dict(item.request))
    assert repeat_key(item) is not None and repeat_key(item) == repeat_key(again)


@pytest.mark.parametrize("given", [["5", 6], [True, False], [1.0, 2.0], [[1], ["2"]], [1, "x"]])
def test_an_embedding_input_of_mixed_types_is_refused_naming_it_not_coerced_to_other_tokens(given):
    """As OpenAI answers it: coerced, `["5", 6]` would embed tokens 5 and 6, which the caller never wrote."""
    import json

    from pydantic import ValidationError

    with pytest.raises(ValidationError) as caught:
        EmbeddingRequest.model_validate_json(json.dumps({"model": "m", "input": given}))
    assert all(error["loc"][0] == "input" for error in caught.value.errors())


def test_repeats_of_an_output_are_written_one_line_each_from_one_serialisation():
    """An embeddings line of 2,048 vectors is ~16 MiB of JSON: a thousand repeats of it are a thousand
    lines, each the output under its own id, never one string of them all."""
    import json

    from batch_pipeline.worker.checkpoint import copy_lines

    output = {"id": "batch-x-1", "object": "list", "data": [{"embedding": [0.5, -1.25]}], "model": "m"}
    lines = copy_lines(output, [3, 7])
    assert not isinstance(lines, (str, list))  # yielded line by line
    parsed = [(int(index), json.loads(body)) for index, _, body in (line.partition("\t") for line in lines)]
    assert parsed == [(3, {**output, "id": "batch-x-3"}), (7, {**output, "id": "batch-x-7"})]
    assert [json.loads(line.split("\t")[1]) for line in copy_lines({"text": "a"}, [2])] == [{"text": "a"}]
    assert list(copy_lines(output, [])) == []


def test_a_record_of_no_kind_is_named_with_what_each_kind_holds():
    from batch_pipeline.contract.records import RecordError, parse_record

    with pytest.raises(RecordError) as caught:
        parse_record({"text": "a"}, "line 3")
    assert str(caught.value) == (
        "line 3: expected `prompts` (v1 content), `prompt` (completion), `messages` (chat), `input` (embeddings) "
        "or `input` with `endpoint` /v1/responses (responses)"
    )


def test_each_kind_with_an_openai_url_is_a_batch_endpoint_and_nothing_else_is():
    from batch_pipeline.contract.kinds import BATCH_ENDPOINTS, KINDS
    from batch_pipeline.contract.openai_batch import BATCH_LINES, CreateBatchRequest

    assert {url: kind.name for url, kind in BATCH_ENDPOINTS.items()} == {
        "/v1/chat/completions": "chat",
        "/v1/completions": "completion",
        "/v1/embeddings": "embeddings",
        "/v1/responses": "responses",
    }
    assert set(BATCH_LINES) == set(BATCH_ENDPOINTS) == {kind.openai_url for kind in KINDS if kind.openai_url}
    for url, kind in BATCH_ENDPOINTS.items():
        assert CreateBatchRequest(input_file_id="file-1", endpoint=url).endpoint == url
        assert BATCH_LINES[url].model_fields["body"].annotation is kind.wire_model
    with pytest.raises(ValidationError) as caught:
        CreateBatchRequest(input_file_id="file-1", endpoint="/v1/moderations")
    assert caught.value.errors()[0]["loc"] == ("endpoint",)
    assert (
        "'/v1/chat/completions', '/v1/completions', '/v1/embeddings' or '/v1/responses'"
        in caught.value.errors()[0]["msg"]
    )


def test_the_v2_content_error_names_the_registry_shapes():
    with pytest.raises(ValidationError) as caught:
        CreateBatchCompletionsV2Request.model_validate(_v1(content="prompts"))
    assert "content must be an object of prompts, or a list of completion or chat requests" in str(caught.value)


def test_no_module_outside_the_kind_registries_names_a_kind():
    """A kind is looked up in the registry (contract/kinds, and worker/kinds.py for its handler), never
    switched on by name: a string equal to a kind's name elsewhere is such a switch. (The `v1` of the
    command line and the client is the API's version, Scale's v1 route, not the kind.)"""
    import ast

    from batch_pipeline.contract.kinds import KINDS

    package = Path(__file__).resolve().parents[2] / "batch_pipeline"
    names = {kind.name for kind in KINDS}
    allowed = {"entrypoints/cli.py", "entrypoints/client.py", "worker/kinds.py"}
    found = [
        f"{module}:{node.lineno} {node.value!r}"
        for path in sorted(package.rglob("*.py"))
        if not (module := path.relative_to(package).as_posix()).startswith("contract/kinds/") and module not in allowed
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in names
    ]
    assert not found, f"kinds switched on by name outside the registry: {found}"


def test_a_responses_line_is_stored_as_its_kind_and_weighed_by_its_instructions_and_input():
    from batch_pipeline.contract.kinds import RESPONSES
    from batch_pipeline.contract.openai_batch import BATCH_LINES
    from batch_pipeline.shards.records import output_limit, work_items

    body = {
        "model": "m",
        "instructions": "Answer briefly.",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "What is two plus two?"}]}],
        "max_output_tokens": 7,
        "text": {"format": {"type": "json_schema", "name": "sum", "schema": {"type": "object"}, "strict": True}},
        "metadata": {"k": "v"},
    }
    line = BATCH_LINES["/v1/responses"].model_validate(
        {"custom_id": "a", "method": "POST", "url": "/v1/responses", "body": body}
    )
    # As openai_batch/jobs.py writes the job's content: the stored record is recognized as a responses one.
    stored = json.loads(line.body.model_dump_json(by_alias=True, exclude_unset=True, exclude={"model"}))
    assert stored["endpoint"] == "/v1/responses" and stored["text"]["format"]["schema"] == {"type": "object"}
    [(item, size)] = list(work_items([("line 1", stored)]))
    assert item.kind == RESPONSES.name and size.prompts == 1
    assert size.tokens == len("Answer briefly.") // 4 + 1 + len("What is two plus two?") // 4 + 1 + 7
    assert output_limit(item) == 7


@pytest.mark.parametrize(
    "body, where",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.list[InputItem].0.role"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "temperature": 3}, "temperature"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "bad name", "schema": {}}}}, "text.format"),
        ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format"),
        ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ],
)
def test_a_malformed_responses_body_is_refused_at_validation_naming_its_field(body, where):
    with pytest.raises(ValidationError) as caught:
        ResponsesRequest.model_validate(body)
    located = [".".join(str(part) for part in error["loc"]) for error in caught.value.errors()]
    assert any(loc.startswith(where) for loc in located), located
