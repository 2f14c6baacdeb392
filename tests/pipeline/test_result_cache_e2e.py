"""A team's result cache across its jobs (issue 49), with real vLLM and real Dagster runs of the
`batch_completions` job, under a tenants file of two teams: a later job of the same team takes the earlier
job's deterministic results instead of generating them, and says so in each entry and in its metadata; no
other team's job, no job with the cache off, no job on other engine arguments, and no sampled request
without a seed ever takes one. A job whose every request hits starts no engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from batch_pipeline.contract import CreateBatchCompletionsV2Request
from batch_pipeline.core.settings import settings
from batch_pipeline.pipeline import step_server
from batch_pipeline.pipeline.execute import execute_request
from batch_pipeline.store.jobs import JobStore
from tests.conftest import MODEL

pytestmark = pytest.mark.slow

MODEL_CONFIG = {"model": MODEL, "dtype": "float32", "max_model_len": 512}


def completion(prompt: str, **fields: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": 12, "temperature": 0, **fields}


DETERMINISTIC = [
    completion("The capital of France is"),
    completion("One, two, three,"),
    completion("Roses are red,", temperature=0.9, seed=7),  # sampled with a seed: its output is fixed
    {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8, "temperature": 0},
]
UNSEEDED = completion("Once upon a time", temperature=1.0)  # sampled without a seed: never cached
REQUESTS = [*DETERMINISTIC, UNSEEDED]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """A DAGSTER_HOME with a tenants file of teams a and b, each with a data root."""
    base = tmp_path_factory.mktemp("result_cache")
    home = base / "dagster_home"
    home.mkdir()
    roots = {name: base / name for name in ("team-a", "team-b")}
    for root in roots.values():
        root.mkdir()
    tenants = base / "tenants.yaml"
    tenants.write_text("tenants:\n" + "".join(f"  {name}:\n    data_roots: [{root}]\n" for name, root in roots.items()))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DAGSTER_HOME", str(home))
        patch.setenv("BATCH_PIPELINE_TENANTS", str(tenants))
        patch.setenv("BATCH_PIPELINE_RESULT_CACHE", "1")  # the deployment's default (tests/conftest.py: off)
        patch.delenv("BATCH_PIPELINE_JOBS_DB", raising=False)
        patch.delenv("BATCH_PIPELINE_WORK_DIR", raising=False)
        from tests.api_fixtures import seed_home

        seed_home(home)
        with dg.instance_for_test(temp_dir=str(home)) as instance:
            yield instance, roots
        step_server.stop()


def run(deployment, team: str, name: str, requests: list[dict[str, Any]], **fields: Any):
    """One job of `team` on `requests`: its output entries and its metadata."""
    instance, roots = deployment
    root = roots[team]
    (root / f"{name}.jsonl").write_text("".join(json.dumps(request) + "\n" for request in requests))
    output = root / f"{name}.json"
    request = CreateBatchCompletionsV2Request.model_validate(
        {
            "input_data_path": str(root / f"{name}.jsonl"),
            "output_data_path": str(output),
            "model_config": fields.pop("model_config", MODEL_CONFIG),
            **fields,
        }
    )
    assert execute_request(request, instance, team=team).success
    return json.loads(output.read_text()), json.loads(Path(f"{output}.metadata.json").read_text())


def without_cache_marks(output: dict[str, Any]) -> dict[str, Any]:
    """An entry as its job computed it: what a hit adds or makes its own (where it came from, its prompt counted
    cached, its id, when it was answered) left out."""
    output = {name: value for name, value in output.items() if name not in ("cached_from_job_id", "id", "created")}
    output["usage"] = {name: value for name, value in output["usage"].items() if name != "prompt_tokens_details"}
    return output


@pytest.fixture(scope="module")
def first(deployment):
    return run(deployment, "team-a", "first", REQUESTS)


def test_a_later_job_of_the_team_takes_the_earlier_jobs_deterministic_results(deployment, first):
    first_outputs, first_metadata = first
    changed = completion("The capital of Spain is")
    outputs, metadata = run(deployment, "team-a", "second", [changed, *DETERMINISTIC[1:], UNSEEDED])

    assert first_metadata["num_cached"] == 0
    assert metadata["num_cached"] == len(DETERMINISTIC) - 1
    for index in range(1, len(DETERMINISTIC)):
        assert outputs[index]["cached_from_job_id"] == first_metadata["job_id"]
        assert without_cache_marks(outputs[index]) == without_cache_marks(first_outputs[index])
        # An id of this job's, as a fresh generation gets: ids never repeat across the team's batches.
        assert outputs[index]["id"] != first_outputs[index]["id"]
        assert outputs[index]["created"] >= first_outputs[index]["created"]
        usage = outputs[index]["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]
    # The changed request and the unseeded sample are generated.
    assert "cached_from_job_id" not in outputs[0] and "cached_from_job_id" not in outputs[-1]
    assert outputs[0]["choices"][0]["text"] != first_outputs[0]["choices"][0]["text"]
    cached_tokens = sum(first_outputs[index]["usage"]["completion_tokens"] for index in range(1, len(DETERMINISTIC)))
    assert metadata["cached_completion_tokens"] == cached_tokens
    # The job's row, which /v2/usage and an OpenAI batch's usage sum, counts them apart.
    record = JobStore(settings().job_store_url).get(metadata["job_id"])
    assert (record.cached_requests, record.cached_completion_tokens) == (len(DETERMINISTIC) - 1, cached_tokens)


def test_a_job_whose_every_request_hits_starts_no_engine(deployment, first):
    first_outputs, first_metadata = first
    outputs, metadata = run(deployment, "team-a", "again", DETERMINISTIC)

    assert metadata["num_cached"] == len(DETERMINISTIC)
    assert [without_cache_marks(output) for output in outputs] == [
        without_cache_marks(output) for output in first_outputs[: len(DETERMINISTIC)]
    ]
    assert all(shard["engine_start_s"] == 0 and shard["generate_s"] == 0 for shard in metadata["shards"])


def test_another_teams_identical_job_is_generated(deployment, first):
    outputs, metadata = run(deployment, "team-b", "same", REQUESTS)

    assert metadata["num_cached"] == 0
    assert not any("cached_from_job_id" in output for output in outputs)
    assert all(shard["generate_s"] > 0 for shard in metadata["shards"])


def test_no_hit_with_the_cache_off_or_other_engine_arguments(deployment, first):
    _, off = run(deployment, "team-a", "off", DETERMINISTIC, cache="off")
    _, other_block = run(deployment, "team-a", "block", DETERMINISTIC, model_config={**MODEL_CONFIG, "block_size": 64})

    assert off["num_cached"] == 0
    assert other_block["num_cached"] == 0
