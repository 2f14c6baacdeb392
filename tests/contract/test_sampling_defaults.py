"""Sampling values a request leaves unset come from the model's generation_config.json, as `vllm serve` (and
Scale's batch server, which calls vLLM's serving classes) takes them; a value the request sets wins; v1
content keeps Scale's own mapping, which reads no generation config. Real jobs, real vLLM, on a copy of the
built-in model whose generation config asks for greedy sampling, a repetition penalty and 5 new tokens."""

import json
from pathlib import Path

import pytest

from batch_pipeline.models.catalog import resolve_model
from tests.conftest import MODEL

pytestmark = pytest.mark.slow

GENERATION_CONFIG = {
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "temperature": 0.0,
    "repetition_penalty": 2.0,
    "max_new_tokens": 5,
}
STORY = "Once upon a time"
CAT = "The cat sat on the mat. The cat sat on the mat. The cat"
REPEATED = " sat on the mat. The cat sat on the mat."  # greedy decoding without a penalty goes on repeating
SAY_OK = [{"role": "user", "content": "Say OK."}]
REQUESTS = {
    # One seed: what temperature 1.0 samples with it is known, so whether the unset one was 1.0 is too.
    "temperature_unset": {"prompt": STORY, "max_tokens": 12, "seed": 5},
    "temperature_1": {"prompt": STORY, "max_tokens": 12, "seed": 5, "temperature": 1.0},
    "temperature_0": {"prompt": STORY, "max_tokens": 12, "temperature": 0},
    "penalty_unset": {"prompt": CAT, "max_tokens": 24, "temperature": 0},
    "penalty_off": {"prompt": CAT, "max_tokens": 24, "temperature": 0, "repetition_penalty": 1.0},
    "chat_max_tokens_unset": {"messages": SAY_OK, "ignore_eos": True},
    "chat_max_tokens_8": {"messages": SAY_OK, "max_tokens": 8, "ignore_eos": True},
    "completion_max_tokens_unset": {"prompt": STORY, "ignore_eos": True},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The built-in model's files (linked) with a generation config of our own."""
    source = Path(resolve_model(MODEL))
    assert not {"temperature", "repetition_penalty", "max_new_tokens"} & set(
        json.loads((source / "generation_config.json").read_text())
    ), "the built-in model sets no sampling values"
    target = tmp_path_factory.mktemp("model")
    for path in source.iterdir():
        if path.name != "generation_config.json":
            (target / path.name).symlink_to(path)
    (target / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return target


def _run(tmp_path_factory, model_dir: Path, content) -> list[dict]:
    import dagster as dg

    from batch_pipeline.contract import CreateBatchCompletionsV2Request
    from batch_pipeline.pipeline.execute import execute_request

    home = tmp_path_factory.mktemp("dagster_home")
    output = home / "output.json"
    if isinstance(content, list):  # chat and completion requests together: a JSONL file, as users send them
        (home / "requests.jsonl").write_text("".join(json.dumps(request) + "\n" for request in content))
        source = {"input_data_path": str(home / "requests.jsonl")}
    else:
        source = {"content": content}
    # A short context bounds what a request without max_tokens could generate.
    request = CreateBatchCompletionsV2Request.model_validate(
        {
            "output_data_path": str(output),
            **source,
            # float32 everywhere: greedy text follows the dtype's numerics.
            "model_config": {
                "model": str(model_dir),
                "served_model_name": MODEL,
                "max_model_len": 256,
                "dtype": "float32",
            },
        }
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DAGSTER_HOME", str(home))
        with dg.instance_for_test(temp_dir=str(home)) as instance:
            assert execute_request(request, instance).success
    return json.loads(output.read_text())


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, model_dir) -> dict[str, dict]:
    return dict(zip(REQUESTS, _run(tmp_path_factory, model_dir, list(REQUESTS.values()))))


def _texts(result: dict) -> list[str]:
    assert "error" not in result, result
    return [choice["text"] if "text" in choice else choice["message"]["content"] for choice in result["choices"]]


def test_an_unset_temperature_is_the_models_and_a_set_one_wins(outputs):
    # temperature 0 from the model: the greedy answer, not the sample the same seed gives at 1.0.
    assert _texts(outputs["temperature_unset"]) == _texts(outputs["temperature_0"])
    assert _texts(outputs["temperature_1"]) != _texts(outputs["temperature_0"])


def test_an_unset_repetition_penalty_is_the_models_and_a_set_one_wins(outputs):
    assert _texts(outputs["penalty_off"])[0].startswith(REPEATED)
    assert not _texts(outputs["penalty_unset"])[0].startswith(" sat on the mat")  # the model's 2.0


def test_an_unset_chat_max_tokens_is_the_models_max_new_tokens(outputs):
    assert outputs["chat_max_tokens_unset"]["usage"]["completion_tokens"] == 5
    assert outputs["chat_max_tokens_8"]["usage"]["completion_tokens"] == 8
    # A completion request's max_tokens defaults to 16 in vLLM's server, whatever the model says.
    assert outputs["completion_max_tokens_unset"]["usage"]["completion_tokens"] == 16


def test_v1_content_reads_no_generation_config_as_scales_batch_server(tmp_path_factory, model_dir, outputs):
    content = {"prompts": [CAT], "max_new_tokens": 24, "temperature": 0.0}
    (v1,) = _run(tmp_path_factory, model_dir, content)
    assert v1["text"].startswith(REPEATED)  # no repetition penalty: v1 has no such field to set
