"""v2 content end to end: OpenAI-style completion and chat requests, each with its own sampling
parameters, through the real job with real vLLM; every checked field is checked against what a user
would verify (the tokenizer's own counts, the schema, the choice set)."""

import json
import re
from pathlib import Path

import jsonschema
import pytest

from tests.conftest import MODEL

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a color."}]
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["city"],
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": CITY}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
# SmolLM2's own template ignores tools; this one shows whether tools and earlier calls reach the template.
TOOLS_TEMPLATE = (
    "{% for t in tools %}tool {{ t.function.name }}\n{% endfor %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %} called {{ c.function.name }} for {{ c.function.arguments.city }}{% endfor %}"
    "\n{% endfor %}assistant:"
)
# Templates receive chat_template_kwargs and documents as variables.
KWARGS_TEMPLATE = (
    "{{ greeting }}{% for d in documents %} [{{ d.title }}: {{ d.text }}]{% endfor %}\n"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
)
REFUSED_FIELDS = {
    "stream": True,
    "stream_options": {"include_usage": True},
    "use_beam_search": True,
    "length_penalty": 0.8,
    "early_stopping": True,
    "guided_decoding_backend": "outlines",
    "guided_whitespace_pattern": "",
    "audio": {"voice": "alloy", "format": "wav"},
    "web_search_options": {},
    "prediction": {"type": "content", "content": "x"},
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "modalities": ["text", "audio"],
}
TOOL_HISTORY = [
    *ASK_WEATHER,
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]

REQUESTS = {
    "logprobs": {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "logprobs": 3},
    "n_and_prompts": {"prompt": ["Roses are red,", "1, 2, 3,"], "max_tokens": 5, "n": 2, "temperature": 0.9},
    "seed_a": {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 11},
    # A field the job ignores keeps seed_b from being a repeat of seed_a: the engine samples it again.
    "seed_b": {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 11, "user": "b"},
    "seed_c": {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 12},
    "stop": {"prompt": "1, 2, 3, 4,", "max_tokens": 20, "temperature": 0, "stop": [" 7"]},
    "stop_kept": {
        "prompt": "1, 2, 3, 4,",
        "max_tokens": 20,
        "temperature": 0,
        "stop": " 7",
        "include_stop_str_in_output": True,
    },
    "echo": {"prompt": "Water boils at", "max_tokens": 4, "temperature": 0, "echo": True},
    "json_schema": {
        "prompt": "A person as JSON:",
        "max_tokens": 48,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    },
    "choice": {"prompt": "Is the sea wet? Answer:", "max_tokens": 4, "guided_choice": ["yes", "no", "maybe"]},
    "regex": {"prompt": "A US zip code:", "max_tokens": 8, "guided_regex": r"[0-9]{5}"},
    "token_ids": {"prompt": [504, 3575, 282, 4649, 314], "max_tokens": 4, "temperature": 0},
    "suffix": {"prompt": "x", "suffix": "y"},
    "best_of": {"prompt": "x", "n": 1, "best_of": 3},
    "best_of_sdk": {"prompt": "Roses are red,", "max_tokens": 4, "n": 2, "best_of": 1, "temperature": 0.9},
    "chat": {"messages": CHAT, "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 2},
    "chat_image": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    "chat_continue": {
        "messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi th"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_tokens": 3,
        "temperature": 0,
    },
    # Each sampling field, with an effect a user can check against a plain run.
    "greedy_top_k": {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 1.0, "seed": 3, "top_k": 1},
    "greedy_top_p": {
        "prompt": "The capital of France is",
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 3,
        "top_p": 0.001,
    },
    "greedy_min_p": {
        "prompt": "The capital of France is",
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 3,
        "min_p": 1.0,
    },
    "logit_bias": {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "logit_bias": {"504": 100}},
    "stop_token_ids": {"prompt": "1, 2, 3, 4,", "max_tokens": 20, "temperature": 0, "stop_token_ids": [39]},
    **{
        name: {
            "prompt": "The cat sat on the mat. The cat sat on the mat. The cat",
            "max_tokens": 24,
            "temperature": 0,
            "logprobs": 0,
            **penalty,
        }
        for name, penalty in [
            ("repeat", {}),
            ("presence_penalty", {"presence_penalty": 2.0}),
            ("frequency_penalty", {"frequency_penalty": 2.0}),
            ("repetition_penalty", {"repetition_penalty": 2.0}),
        ]
    },
    "short_answer": {"messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 40, "temperature": 0},
    "min_tokens": {
        "messages": [{"role": "user", "content": "Say OK."}],
        "max_tokens": 40,
        "temperature": 0,
        "min_tokens": 40,
    },
    "ignore_eos": {
        "messages": [{"role": "user", "content": "Say OK."}],
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
    },
    "max_completion_tokens": {"messages": CHAT, "max_tokens": 30, "max_completion_tokens": 3, "ignore_eos": True},
    "special_kept": {
        "prompt": "Hello",
        "max_tokens": 2,
        "logit_bias": {"1": 100},
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
    },
    "special_spaced": {"prompt": "Hello", "max_tokens": 2, "logit_bias": {"1": 100}, "skip_special_tokens": False},
    "special_skipped": {"prompt": "Hello", "max_tokens": 2, "logit_bias": {"1": 100}},
    "json_object": {
        "prompt": "An empty JSON object:",
        "max_tokens": 32,
        "temperature": 0,
        "response_format": {"type": "json_object"},
    },
    "guided_json": {"prompt": "A person as JSON:", "max_tokens": 48, "temperature": 0, "guided_json": PERSON},
    "guided_grammar": {"prompt": "Is fire hot? Answer:", "max_tokens": 4, "guided_grammar": 'root ::= "yes" | "no"'},
    "template_kwargs": {
        "messages": CHAT,
        "max_tokens": 2,
        "chat_template": KWARGS_TEMPLATE,
        "chat_template_kwargs": {"greeting": "Ahoy"},
        "documents": [{"title": "Sea", "text": "wet"}],
    },
    "ignored_fields": {
        "messages": CHAT,
        "max_tokens": 2,
        "model": "gpt-4o",
        "user": "u1",
        "metadata": {"a": "b"},
        "store": True,
        "service_tier": "auto",
        "reasoning_effort": "low",
        "priority": 3,
    },
    **{f"refused_{field}": {"messages": CHAT, field: value} for field, value in REFUSED_FIELDS.items()},
    # model_config.tool_call_parser is "pythonic"; a regex stands in for a model trained to call tools.
    "tool_auto": {
        "messages": ASK_WEATHER,
        "tools": [WEATHER, TIME],
        "max_tokens": 24,
        "guided_regex": r"\[get_weather\(city='(Paris|Rome)'\)\]",
    },
    "tool_auto_answer": {
        "messages": ASK_WEATHER,
        "tools": [WEATHER],
        "tool_choice": "auto",
        "max_tokens": 24,
        "guided_choice": ["It is sunny."],
    },
    "tool_named": {
        "messages": ASK_WEATHER,
        "tools": [WEATHER, TIME],
        "max_tokens": 48,
        "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
    },
    "tool_required": {
        "messages": ASK_WEATHER,
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 64,
        "temperature": 0,
    },
    "tool_none": {
        "messages": ASK_WEATHER,
        "tools": [WEATHER],
        "tool_choice": "none",
        "max_tokens": 6,
        "temperature": 0,
    },
    "tool_history": {
        "messages": TOOL_HISTORY,
        "tools": [WEATHER],
        "chat_template": TOOLS_TEMPLATE,
        "max_tokens": 4,
        "temperature": 0,
    },
    "tool_unknown": {
        "messages": ASK_WEATHER,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_news"}},
    },
    # ~9000 tokens, past the model's 8192
    "too_long_prompt": {"prompt": "hi " * 9000, "max_tokens": 4},
    "too_long_chat": {"messages": [{"role": "user", "content": "hi " * 9000}], "max_tokens": 4},
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    import dagster as dg

    from batch_pipeline.contract import CreateBatchCompletionsV2Request
    from batch_pipeline.pipeline.execute import execute_request

    home = tmp_path_factory.mktemp("dagster_home")
    input_path = home / "requests.jsonl"
    input_path.write_text("".join(json.dumps(r) + "\n" for r in REQUESTS.values()))
    output_path = home / "output.json"
    request = CreateBatchCompletionsV2Request.model_validate(
        {
            "input_data_path": str(input_path),
            "output_data_path": str(output_path),
            "model_config": {"model": MODEL, "tool_call_parser": "pythonic", "response_role": "bot"},
        }
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DAGSTER_HOME", str(home))
        with dg.instance_for_test(temp_dir=str(home)) as instance:
            assert execute_request(request, instance).success
    results = json.loads(output_path.read_text())
    metadata = json.loads(Path(str(output_path) + ".metadata.json").read_text())
    return dict(zip(REQUESTS, results)), metadata


def test_completion_objects_carry_usage_equal_to_the_tokenizers_counts(outputs, tokenizer):
    results, metadata = outputs
    for name in ("logprobs", "echo", "stop"):
        result = results[name]
        assert result["object"] == "text_completion" and result["model"] == MODEL
        assert result["usage"]["prompt_tokens"] == len(tokenizer(REQUESTS[name]["prompt"]).input_ids)
        assert (
            result["usage"]["total_tokens"] == result["usage"]["prompt_tokens"] + result["usage"]["completion_tokens"]
        )
    completion_tokens = sum(r["usage"]["completion_tokens"] for r in results.values() if "usage" in r)
    assert metadata["completion_tokens"] == completion_tokens
    assert metadata["num_errors"] == 6 + len(REFUSED_FIELDS)


def test_logprobs_are_log_probabilities_with_sorted_top_k(outputs):
    (choice,) = outputs[0]["logprobs"]["choices"]
    logprobs = choice["logprobs"]
    assert (
        len(logprobs["tokens"])
        == len(logprobs["token_logprobs"])
        == outputs[0]["logprobs"]["usage"]["completion_tokens"]
    )
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert all(value <= 0.0 for value in logprobs["token_logprobs"])
    for chosen, top in zip(logprobs["token_logprobs"], logprobs["top_logprobs"]):
        values = list(top.values())
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert max(values) >= chosen - 1e-6  # greedy: the chosen token is the most likely one
    chat = outputs[0]["chat"]["choices"][0]
    assert len(chat["logprobs"]["content"]) == outputs[0]["chat"]["usage"]["completion_tokens"]
    for entry in chat["logprobs"]["content"]:
        tops = [t["logprob"] for t in entry["top_logprobs"]]
        assert len(tops) == 2 and tops == sorted(tops, reverse=True) and entry["logprob"] <= 0.0


def test_n_and_prompt_lists_give_every_choice_in_order(outputs):
    choices = outputs[0]["n_and_prompts"]["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert all(c["finish_reason"] == "length" for c in choices)


def test_best_of_up_to_n_is_served_as_scales_sdk_sends_it(outputs):
    assert [choice["index"] for choice in outputs[0]["best_of_sdk"]["choices"]] == [0, 1]


def test_a_seed_reproduces_a_sample_and_another_seed_does_not(outputs):
    texts = {name: outputs[0][name]["choices"][0]["text"] for name in ("seed_a", "seed_b", "seed_c")}
    assert texts["seed_a"] == texts["seed_b"]
    assert texts["seed_a"] != texts["seed_c"]


def test_stop_strings_end_generation_and_are_kept_only_when_asked(outputs):
    stopped = outputs[0]["stop"]["choices"][0]
    kept = outputs[0]["stop_kept"]["choices"][0]
    assert stopped["finish_reason"] == "stop" and " 7" not in stopped["text"]
    assert kept["text"] == stopped["text"] + " 7"


def test_echo_returns_the_prompt_first(outputs):
    assert outputs[0]["echo"]["choices"][0]["text"].startswith("Water boils at")


def test_structured_outputs_follow_their_schema_choice_and_regex(outputs):
    person = json.loads(outputs[0]["json_schema"]["choices"][0]["text"])
    jsonschema.validate(person, PERSON)
    assert outputs[0]["choice"]["choices"][0]["text"] in {"yes", "no", "maybe"}
    assert re.fullmatch(r"[0-9]{5}", outputs[0]["regex"]["choices"][0]["text"])


def test_token_id_prompts_are_taken_as_given(outputs):
    assert outputs[0]["token_ids"]["usage"]["prompt_tokens"] == 5


def test_chat_uses_the_models_template(outputs, tokenizer):
    chat = outputs[0]["chat"]
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "bot" and chat["choices"][0]["message"]["content"]
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert chat["usage"]["prompt_tokens"] == len(rendered["input_ids"])
    continued = outputs[0]["chat_continue"]
    prefix = tokenizer.apply_chat_template(
        REQUESTS["chat_continue"]["messages"], continue_final_message=True, tokenize=True, return_dict=True
    )
    assert continued["usage"]["prompt_tokens"] == len(prefix["input_ids"])


def test_requests_that_cannot_be_served_fail_alone_naming_the_field(outputs):
    for name, param in [
        ("suffix", "suffix"),
        ("best_of", "best_of"),
        ("chat_image", "messages.0.content.0"),
        ("tool_unknown", "tool_choice"),
    ]:
        error = outputs[0][name]["error"]
        assert error["param"] == param and error["message"].startswith(f"{param}:"), error
        assert error["type"] == "invalid_request_error"
    assert "get_news" in outputs[0]["tool_unknown"]["error"]["message"]


@pytest.mark.parametrize(("name", "param"), [("too_long_prompt", "prompt"), ("too_long_chat", "messages")])
def test_error_entries_are_openais_error_object_naming_the_field(outputs, name, param):
    from openai.types.shared import ErrorObject

    error = outputs[0][name]["error"]
    assert list(error) == ["message", "type", "param", "code"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, "prompt_too_long")
    assert "8192" in error["message"]
    assert ErrorObject.model_validate(error).param == param  # the openai SDK's own type reads it


def _calls(result):
    (choice,) = result["choices"]
    return choice, [
        (call["function"]["name"], json.loads(call["function"]["arguments"]))
        for call in choice["message"].get("tool_calls", [])
    ]


def test_auto_tool_choice_reads_calls_with_the_configured_parser(outputs):
    choice, calls = _calls(outputs[0]["tool_auto"])
    assert len(calls) == 1 and calls[0][0] == "get_weather" and calls[0][1]["city"] in {"Paris", "Rome"}
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["type"] == "function" and choice["message"]["tool_calls"][0]["id"]
    answer, calls = _calls(outputs[0]["tool_auto_answer"])
    assert calls == [] and answer["message"]["content"] == "It is sunny." and answer["finish_reason"] == "stop"
    assert "tool_calls" not in answer["message"]  # as OpenAI's message that calls no tool


def test_named_and_required_tool_choice_give_calls_that_match_the_tools_parameters(outputs):
    choice, calls = _calls(outputs[0]["tool_named"])
    assert [name for name, _ in calls] == ["get_time"]
    jsonschema.validate(calls[0][1], CITY)
    assert choice["finish_reason"] == "stop"  # OpenAI's convention for a named tool
    choice, calls = _calls(outputs[0]["tool_required"])
    assert len(calls) == 1 and calls[0][0] in {"get_weather", "get_time"}  # parallel_tool_calls: false
    jsonschema.validate(calls[0][1], CITY)
    assert choice["finish_reason"] == "tool_calls"
    choice, calls = _calls(outputs[0]["tool_none"])
    assert calls == [] and choice["message"]["content"]


def test_tools_and_earlier_calls_reach_the_chat_template(outputs, tokenizer):
    messages = json.loads(json.dumps(TOOL_HISTORY))
    messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    rendered = tokenizer.apply_chat_template(
        messages, tools=[WEATHER], chat_template=TOOLS_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert "tool get_weather" in rendered and "called get_weather for Paris" in rendered
    prompt_ids = tokenizer(rendered, add_special_tokens=False).input_ids
    assert outputs[0]["tool_history"]["usage"]["prompt_tokens"] == len(prompt_ids)


def _text(result):
    return result["choices"][0].get("text", result["choices"][0].get("message", {}).get("content"))


def test_top_k_top_p_and_min_p_can_narrow_sampling_to_the_greedy_choice(outputs):
    greedy = _text(outputs[0]["logprobs"])
    assert [_text(outputs[0][name]) for name in ("greedy_top_k", "greedy_top_p", "greedy_min_p")] == [greedy] * 3


def test_logit_bias_and_stop_token_ids_act_on_token_ids(outputs, tokenizer):
    assert _text(outputs[0]["logit_bias"]) == tokenizer.decode([504] * 3)
    stopped = outputs[0]["stop_token_ids"]["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == 39 and "7" not in stopped["text"]
    assert stopped["text"].rstrip() == _text(outputs[0]["stop"])  # the stop string " 7" also took the space


def test_penalties_make_a_repetitive_continuation_more_varied(outputs):
    distinct = {
        name: len(set(outputs[0][name]["choices"][0]["logprobs"]["tokens"]))
        for name in ("repeat", "presence_penalty", "frequency_penalty", "repetition_penalty")
    }
    assert all(distinct[name] > distinct["repeat"] for name in distinct if name != "repeat"), distinct


def test_min_tokens_ignore_eos_and_max_completion_tokens_set_the_length(outputs):
    short = outputs[0]["short_answer"]
    assert short["choices"][0]["finish_reason"] == "stop" and short["usage"]["completion_tokens"] < 40
    for name in ("min_tokens", "ignore_eos"):
        assert outputs[0][name]["usage"]["completion_tokens"] == 40, name
    assert outputs[0]["max_completion_tokens"]["usage"]["completion_tokens"] == 3


def test_special_tokens_are_shown_only_when_asked(outputs):
    # spaces_between_special_tokens reaches vLLM, whose fast-tokenizer detokenizer does not use it
    assert _text(outputs[0]["special_kept"]) == _text(outputs[0]["special_spaced"]) == "<|im_start|><|im_start|>"
    assert _text(outputs[0]["special_skipped"]) == ""


def test_json_object_guided_json_and_grammar_constrain_the_output(outputs):
    assert isinstance(json.loads(_text(outputs[0]["json_object"])), dict)
    jsonschema.validate(json.loads(_text(outputs[0]["guided_json"])), PERSON)
    assert _text(outputs[0]["guided_grammar"]) in {"yes", "no"}


def test_chat_template_kwargs_and_documents_reach_the_template(outputs, tokenizer):
    rendered = tokenizer.apply_chat_template(
        CHAT,
        chat_template=KWARGS_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
        documents=[{"title": "Sea", "text": "wet"}],
        greeting="Ahoy",
    )
    assert rendered.startswith("Ahoy [Sea: wet]")
    prompt_ids = tokenizer(rendered, add_special_tokens=False).input_ids
    assert outputs[0]["template_kwargs"]["usage"]["prompt_tokens"] == len(prompt_ids)


def test_fields_the_job_decides_are_accepted_and_ignored(outputs):
    result = outputs[0]["ignored_fields"]
    assert "error" not in result and result["model"] == MODEL


@pytest.mark.parametrize("field", sorted(REFUSED_FIELDS))
def test_fields_no_request_can_use_fail_that_request_naming_the_field(outputs, field):
    error = outputs[0][f"refused_{field}"]["error"]
    assert error["message"].startswith(f"{field}:")
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", field, "unsupported_field")
