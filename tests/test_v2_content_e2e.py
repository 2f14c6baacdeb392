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

REQUESTS = {
    "logprobs": {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "logprobs": 3},
    "n_and_prompts": {"prompt": ["Roses are red,", "1, 2, 3,"], "max_tokens": 5, "n": 2, "temperature": 0.9},
    "seed_a": {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 11},
    "seed_b": {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 11},
    "seed_c": {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 12},
    "stop": {"prompt": "1, 2, 3, 4,", "max_tokens": 20, "temperature": 0, "stop": [" 7"]},
    "stop_kept": {"prompt": "1, 2, 3, 4,", "max_tokens": 20, "temperature": 0, "stop": " 7",
                  "include_stop_str_in_output": True},
    "echo": {"prompt": "Water boils at", "max_tokens": 4, "temperature": 0, "echo": True},
    "json_schema": {"prompt": "A person as JSON:", "max_tokens": 48, "temperature": 0,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
    "choice": {"prompt": "Is the sea wet? Answer:", "max_tokens": 4, "guided_choice": ["yes", "no", "maybe"]},
    "regex": {"prompt": "A US zip code:", "max_tokens": 8, "guided_regex": r"[0-9]{5}"},
    "token_ids": {"prompt": [504, 3575, 282, 4649, 314], "max_tokens": 4, "temperature": 0},
    "suffix": {"prompt": "x", "suffix": "y"},
    "best_of": {"prompt": "x", "n": 1, "best_of": 3},
    "chat": {"messages": CHAT, "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 2},
    "chat_image": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    "chat_continue": {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi th"}],
                      "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 3,
                      "temperature": 0},
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
        {"input_data_path": str(input_path), "output_data_path": str(output_path), "model_config": {"model": MODEL}}
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
        assert result["usage"]["total_tokens"] == result["usage"]["prompt_tokens"] + result["usage"]["completion_tokens"]
    completion_tokens = sum(r["usage"]["completion_tokens"] for r in results.values() if "usage" in r)
    assert metadata["completion_tokens"] == completion_tokens
    assert metadata["num_errors"] == 3


def test_logprobs_are_log_probabilities_with_sorted_top_k(outputs):
    (choice,) = outputs[0]["logprobs"]["choices"]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == outputs[0]["logprobs"]["usage"]["completion_tokens"]
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
    assert chat["choices"][0]["message"]["role"] == "assistant" and chat["choices"][0]["message"]["content"]
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert chat["usage"]["prompt_tokens"] == len(rendered["input_ids"])
    continued = outputs[0]["chat_continue"]
    prefix = tokenizer.apply_chat_template(
        REQUESTS["chat_continue"]["messages"], continue_final_message=True, tokenize=True, return_dict=True
    )
    assert continued["usage"]["prompt_tokens"] == len(prefix["input_ids"])


def test_requests_that_cannot_be_served_fail_alone_naming_the_field(outputs):
    assert outputs[0]["suffix"]["error"]["message"].startswith("suffix:")
    assert outputs[0]["best_of"]["error"]["message"].startswith("best_of:")
    assert outputs[0]["chat_image"]["error"]["message"].startswith("messages.0.content.0:")
