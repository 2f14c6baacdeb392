"""Deterministic requests (greedy, or sampled with a seed) that differ only in their output limit share one
generation, and each gets exactly what its own generation gives: the same job run twice with real vLLM,
once generating every request on its own (BATCH_PIPELINE_DEDUPLICATE=0) and once sharing, compared field
by field.

float32, so that the engine's numbers do not depend on which requests share its batches (in bfloat16 they
may, shared or not)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import MODEL

pytestmark = pytest.mark.slow

STORY = [{"role": "user", "content": "Tell me a short story about a cat."}]
ONE_WORD = [{"role": "user", "content": "Answer with one word: what color is the sky?"}]


def completion(prompt: str, limit: int, **fields: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": limit, "temperature": 0, "logprobs": 2, **fields}


def chat(messages: list[dict[str, str]], limit: int, field: str = "max_completion_tokens") -> dict[str, Any]:
    return {"messages": messages, field: limit, "temperature": 0, "logprobs": True, "top_logprobs": 2}


def v1(prompts: list[str], limit: int) -> dict[str, Any]:
    return {"prompts": prompts, "max_new_tokens": limit, "temperature": 0, "return_token_log_probs": True}


REQUESTS = [
    completion("The capital of France is", 40),
    completion("The capital of France is", 1),
    completion("The capital of France is", 7),
    # The stop string ends the longest after the shorter's limit: the shorter is cut, finished by length.
    completion("1, 2, 3, 4,", 30, stop=[" 9"]),
    completion("1, 2, 3, 4,", 3, stop=[" 9"]),
    # Echo puts the prompt before each cut.
    completion("Roses are red,", 12, echo=True),
    completion("Roses are red,", 5, echo=True),
    chat(STORY, 48),
    chat(STORY, 9, field="max_tokens"),
    chat(STORY, 20),
    # Ends on its own (end of sequence) well before its limit, as do those sharing it.
    chat(ONE_WORD, 60),
    chat(ONE_WORD, 30),
    v1(["Once upon a time", "The sky is"], 24),
    v1(["Once upon a time"], 6),
    # Sampled with a seed: the same sample, whatever the limit. With another seed it shares nothing.
    completion("The capital of France is", 5, temperature=0.8, seed=3),
    completion("Once upon a time", 30, temperature=0.9, seed=5),
    completion("Once upon a time", 12, temperature=0.9, seed=5),
    {**chat(STORY, 40), "temperature": 1.0, "top_p": 0.9, "seed": 8},
    {**chat(STORY, 10), "temperature": 1.0, "top_p": 0.9, "seed": 8},
]


def run(home: Path, requests: list[dict[str, Any]], deduplicate: bool) -> tuple[list[dict], dict]:
    import dagster as dg

    from batch_pipeline.contract import CreateBatchCompletionsV2Request
    from batch_pipeline.pipeline import step_server
    from batch_pipeline.pipeline.execute import execute_request

    input_path = home / "requests.jsonl"
    input_path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    output_path = home / "output.json"
    request = CreateBatchCompletionsV2Request.model_validate(
        {
            "input_data_path": str(input_path),
            "output_data_path": str(output_path),
            "model_config": {"model": MODEL, "dtype": "float32", "max_model_len": 512},
        }
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DAGSTER_HOME", str(home))
        patch.setenv("BATCH_PIPELINE_DEDUPLICATE", "1" if deduplicate else "0")
        with dg.instance_for_test(temp_dir=str(home)) as instance:
            assert execute_request(request, instance).success
        step_server.stop()  # it keeps the environment it started in: the next run's steps see their own
    metadata = json.loads(Path(str(output_path) + ".metadata.json").read_text())
    return json.loads(output_path.read_text()), metadata


def comparable(output: dict[str, Any]) -> dict[str, Any]:
    """An output as the user compares it: everything but when it was made and its id (unique to each run, as
    OpenAI's are)."""
    return {name: value for name, value in output.items() if name not in ("created", "id")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    separate, separate_metadata = run(tmp_path_factory.mktemp("separate"), REQUESTS, deduplicate=False)
    # One more request, at the limit where the one-word answer ended on its own: its generation stops
    # there by the end of sequence, as vLLM checks that before the limit.
    natural = separate[REQUESTS.index(chat(ONE_WORD, 60))]["usage"]["completion_tokens"]
    shared, shared_metadata = run(
        tmp_path_factory.mktemp("shared"), [*REQUESTS, chat(ONE_WORD, natural)], deduplicate=True
    )
    return separate, separate_metadata, shared, shared_metadata


def test_every_request_gets_what_its_own_generation_gives(runs):
    separate, separate_metadata, shared, shared_metadata = runs

    # v1 content fans out per prompt: its three prompts take three entries.
    assert (len(separate), len(shared)) == (len(REQUESTS) + 1, len(REQUESTS) + 2)
    assert [comparable(output) for output in shared[:-1]] == [comparable(output) for output in separate]
    assert (separate_metadata["num_cut_from_longer"], shared_metadata["num_cut_from_longer"]) == (0, 11)


def test_a_cut_answer_ends_by_length_with_its_own_usage_and_logprobs(runs):
    separate, _, shared, _ = runs
    short, long = shared[REQUESTS.index(chat(STORY, 9, field="max_tokens"))], shared[REQUESTS.index(chat(STORY, 48))]

    assert short["choices"][0]["finish_reason"] == "length"
    assert short["usage"]["completion_tokens"] == len(short["choices"][0]["logprobs"]["content"]) == 9
    assert short["choices"][0]["logprobs"]["content"] == long["choices"][0]["logprobs"]["content"][:9]
    stopped = shared[REQUESTS.index(completion("1, 2, 3, 4,", 3, stop=[" 9"]))]["choices"][0]
    assert (stopped["finish_reason"], stopped["stop_reason"], len(stopped["logprobs"]["tokens"])) == ("length", None, 3)


def test_a_request_at_the_length_where_the_answer_ended_ends_as_the_answer_did(runs):
    separate, _, shared, _ = runs
    on_its_own = separate[REQUESTS.index(chat(ONE_WORD, 60))]
    at_its_end = shared[-1]

    assert on_its_own["choices"][0]["finish_reason"] == "stop"
    assert at_its_end["usage"] == on_its_own["usage"]
    assert comparable(at_its_end)["choices"] == on_its_own["choices"]
