"""`POST /v2/batch-completions?dry_run=true`: the request checked, read and tokenized as its job would be,
the cost estimated from the deployment's own history; nothing launched, stored or written."""

import json

import pytest

from batch_pipeline.contract import CreateBatchCompletionsV2Request
from batch_pipeline.pipeline.execute import execute_request
from tests.api_fixtures import OTHER_KEY, USER_KEY
from tests.conftest import MODEL, step_failure_messages
from tests.core.test_s3 import s3 as s3  # the moto S3 server fixture
from tests.openai_batch.test_openai_batch import EMBEDDINGS, _embedding_line, _jsonl, _upload

# Each dry run checks its requests in a child process that imports vLLM (~10 s a test here).
pytestmark = pytest.mark.slow

ALICE = {"x-api-key": USER_KEY}
BOB = {"x-api-key": OTHER_KEY}
CONTEXT = 8192  # SmolLM2-135M's max_position_embeddings


def _body(tmp_path, content=None, **fields) -> dict:
    body = {"output_data_path": str(tmp_path / "out" / "output.json"), "model_config": {"model": MODEL}, **fields}
    if content is not None:
        body["content"] = content
    return body


def _dry_run(api, body, headers=ALICE):
    return api.client.post("/v2/batch-completions", params={"dry_run": "true"}, json=body, headers=headers)


def _nothing_stored(api) -> None:
    assert api.client.get("/v2/batch-completions", headers=ALICE).json()["jobs"] == []
    assert api.store.list().jobs == []
    work = api.home / "work"
    assert not work.exists() or not any(work.iterdir())


def test_a_dry_run_counts_tokens_and_lists_what_cannot_run_and_stores_nothing(deployment_factory, tmp_path, tokenizer):
    api = deployment_factory()
    content = [
        {"prompt": "The capital of France is", "max_tokens": 5},
        {"prompt": "word " * 9000, "max_tokens": 5},  # past the context
        {"prompt": "Count:", "max_tokens": 10_000, "n": 2},  # runs, and stops at the context
        {"prompt": "x", "suffix": "y"},  # a field the worker refuses
        {"prompt": ["One", "Two"]},  # two prompts, the default 16 tokens each
    ]
    response = _dry_run(api, _body(tmp_path, content, data_parallelism=2))
    assert response.status_code == 200, response.text
    answer = response.json()

    def tokens(text: str) -> int:
        return len(tokenizer.encode(text))

    assert answer["dry_run"] is True and answer["model"] == MODEL and answer["context_length"] == CONTEXT
    assert (answer["num_requests"], answer["num_prompts"]) == (5, 4)
    assert answer["prompt_tokens"] == sum(map(tokens, ["The capital of France is", "Count:", "One", "Two"]))
    assert answer["max_output_tokens"] == 5 + 2 * (CONTEXT - tokens("Count:")) + 16 + 16
    assert answer["num_cannot_run"] == 2
    too_long, refused = answer["cannot_run"]
    assert (too_long["index"], too_long["code"]) == (1, "prompt_too_long")
    assert f"context of {CONTEXT}" in too_long["message"]
    assert (refused["index"], refused["code"]) == (3, "unsupported_field") and "suffix" in refused["message"]
    assert answer["num_cut_at_context"] == 1
    assert [(p["index"], p["code"]) for p in answer["cut_at_context"]] == [(2, "output_past_context")]
    _nothing_stored(api)

    # Chat requests are counted through the model's chat template, as the worker renders them.
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    chat = _dry_run(api, _body(tmp_path, [{"messages": messages, "max_tokens": 7}])).json()
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["prompt_tokens"] == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert chat["max_output_tokens"] == 7 and chat["num_cannot_run"] == 0
    _nothing_stored(api)


def test_a_dry_run_reads_an_input_file_as_the_job_does(deployment_factory, tmp_path, tokenizer):
    api = deployment_factory()
    records = [
        {"prompts": ["Hello", "Bonjour"], "max_new_tokens": 3, "temperature": 0.0},
        {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 4},
        {"prompt": "1, 2, 3,", "max_tokens": 2},
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    answer = _dry_run(api, _body(tmp_path, input_data_path=str(path))).json()
    assert (answer["num_requests"], answer["num_prompts"]) == (4, 4)  # v1 content: one request per prompt
    assert answer["max_output_tokens"] == 3 + 3 + 4 + 2

    path.write_text(json.dumps(records[0]) + "\n{not json\n")
    malformed = _dry_run(api, _body(tmp_path, input_data_path=str(path)))
    assert malformed.status_code == 422
    (error,) = malformed.json()["detail"]
    assert error["loc"] == ["body", "input_data_path"] and "line 2" in error["msg"]
    missing = _dry_run(api, _body(tmp_path, input_data_path=str(tmp_path / "nowhere.jsonl")))
    assert missing.status_code == 422 and missing.json()["detail"][0]["loc"] == ["body", "input_data_path"]
    _nothing_stored(api)


def test_a_dry_run_with_no_history_says_so(deployment_factory, tmp_path):
    api = deployment_factory()
    answer = _dry_run(api, _body(tmp_path, {"prompts": ["Hello"], "max_new_tokens": 4, "temperature": 0.0})).json()
    assert answer["estimate"] is None
    assert answer["no_history"] == (
        f"no history: no job of '{MODEL}' has completed on this deployment yet, so "
        "there is no throughput to estimate from"
    )


def test_a_dry_run_after_a_completed_job_estimates_from_its_throughput(deployment_factory, tmp_path):
    api = deployment_factory()
    content = {"prompts": ["Once upon a time", "The capital of France is"], "max_new_tokens": 24, "temperature": 0.0}
    request = CreateBatchCompletionsV2Request.model_validate(_body(tmp_path, content))
    result = execute_request(request, api.instance)  # the real job, through the same submission path
    assert result.success, step_failure_messages(result)
    (job,) = api.store.list().jobs
    assert job.status == "completed" and job.results.completion_tokens_per_s > 0
    # Over its shard's generation, not its wall (engine start, planning, merging): issue 46.
    results = job.results
    assert results.completion_tokens_per_s > results.completion_tokens_per_wall_s > 0
    assert 0 < results.engine_start_s < results.wall_s

    asked = {"prompts": ["Hello"] * 10, "max_new_tokens": 100, "temperature": 0.7}
    answer = _dry_run(api, _body(tmp_path, asked, cpus="2", gpus=1)).json()
    estimate = answer["estimate"]
    assert answer["no_history"] is None and answer["max_output_tokens"] == 1000
    rate = job.results.completion_tokens_per_s  # one shard worker made it
    assert estimate["from_jobs"] == 1 and estimate["completion_tokens_per_s"] == pytest.approx(rate, abs=0.01)
    assert estimate["workers"] == 1
    assert estimate["engine_start_s"] == pytest.approx(results.engine_start_s, abs=0.05)
    assert estimate["wall_s"] == pytest.approx(estimate["engine_start_s"] + 1000 / rate, abs=0.1)
    assert estimate["worker_hours"] == pytest.approx(estimate["wall_s"] / 3600, abs=1e-4)
    # Each figure is rounded to 4 places on its own: twice a rounded one may differ by a unit and a half.
    assert estimate["cpu_hours"] == pytest.approx(2 * estimate["worker_hours"], abs=2e-4)
    assert estimate["gpu_hours"] == pytest.approx(estimate["worker_hours"], abs=1e-4)
    assert len(api.store.list().jobs) == 1  # the dry run added none

    # The context is the request's max_model_len where it sets one, as the engine's.
    other = _dry_run(api, _body(tmp_path, asked, model_config={"model": MODEL, "max_model_len": 512}))
    assert other.json()["context_length"] == 512 and other.json()["estimate"] is not None


def test_a_dry_run_naming_a_forbidden_path_is_refused_like_a_real_submission(deployment_factory, tmp_path, monkeypatch):
    root = tmp_path / "data"
    root.mkdir()
    monkeypatch.setenv("BATCH_PIPELINE_DATA_ROOTS", str(root))
    api = deployment_factory()
    output = {"output_data_path": str(root / "out.json"), "model_config": {"model": MODEL}}
    # Bob's job: its prompts are written to its work dir, outside the data roots.
    bob_job = api.client.post(
        "/v2/batch-completions",
        headers=BOB,
        json={**output, "content": {"prompts": ["Bob's secret"], "max_new_tokens": 1, "temperature": 0.0}},
    ).json()["job_id"]
    bobs_content = api.store.get(bob_job).content_path
    assert bobs_content.startswith(str(api.home / "work"))

    for path in (bobs_content, "/etc/passwd", f"{root}/../escape.json", "memory://x.json"):
        body = {**output, "input_data_path": path}
        real = api.client.post("/v2/batch-completions", json=body, headers=ALICE)
        dry = _dry_run(api, body)
        assert real.status_code == dry.status_code == 422, (path, real.text, dry.text)
        assert dry.json() == real.json()
        assert dry.json()["detail"][0]["loc"] == ["body", "input_data_path"]
    assert [job.job_id for job in api.store.list().jobs] == [bob_job]


def test_a_dry_run_lists_at_most_a_hundred_problems_and_counts_them_all(deployment_factory, tmp_path):
    api = deployment_factory()
    answer = _dry_run(api, _body(tmp_path, [{"prompt": "x", "suffix": "y"}] * 150)).json()
    assert answer["num_cannot_run"] == 150 and len(answer["cannot_run"]) == 100
    assert [p["index"] for p in answer["cannot_run"]] == list(range(100))


def test_dry_runs_past_the_servers_limit_get_429_and_the_route_documents_the_parameter(
    deployment_factory, tmp_path, monkeypatch
):
    monkeypatch.setenv("BATCH_PIPELINE_MAX_CONCURRENT_DRY_RUNS", "1")
    api = deployment_factory()
    body = _body(tmp_path, {"prompts": ["Hello"], "max_new_tokens": 4, "temperature": 0.0})
    with api.service.dry_runs.slots.hold("another team"):  # one dry run in progress, as many as this server takes
        busy = _dry_run(api, body)
    assert busy.status_code == 429 and busy.headers["retry-after"] == "5"
    assert _dry_run(api, body).status_code == 200

    operation = api.client.get("/openapi.json").json()["paths"]["/v2/batch-completions"]["post"]
    (parameter,) = [p for p in operation["parameters"] if p["name"] == "dry_run"]
    assert parameter["in"] == "query" and "BatchCompletionsEstimate" in parameter["description"]
    answers = json.dumps(operation["responses"]["200"])
    assert "BatchCompletionsEstimate" in answers and "BatchCompletionsJob" in answers


def test_a_model_the_engine_could_not_load_is_a_422_naming_the_field(deployment_factory, tmp_path):
    api = deployment_factory()
    content = {"prompts": ["Hello"], "max_new_tokens": 4, "temperature": 0.0}
    cases = [
        ({"model": "no-such-org/no-such-model"}, ["body", "model_config", "model"]),
        ({"model": MODEL, "max_model_len": 100_000}, ["body", "model_config", "max_model_len"]),
    ]
    for model_config, location in cases:
        response = _dry_run(api, _body(tmp_path, content, model_config=model_config))
        assert response.status_code == 422, response.text
        (error,) = response.json()["detail"]
        assert error["loc"] == location and "the model cannot be read here" in error["msg"]
        assert "ArgsKwargs" not in error["msg"]  # vLLM's validation error, without the arguments it echoes
    _nothing_stored(api)


def test_a_submission_naming_a_model_no_engine_here_could_load_is_a_422_naming_the_field(deployment_factory, tmp_path):
    # Issue 46: such a job was accepted, its shard retried twice, each starting an engine, and it failed
    # ~3.5 minutes later; the dry run already said why. v1, v2 and the OpenAI batch create now read the
    # model as the dry run does and refuse it before anything is stored.
    from tests.openai_batch.test_openai_batch import _create, _jsonl, _line, _upload

    api = deployment_factory()
    content = {"prompts": ["Hello"], "max_new_tokens": 4, "temperature": 0.0}
    for model in ("no-such-model", "no-such-org/no-such-model"):
        body = _body(tmp_path, content, model_config={"model": model})
        for route in ("/v1/llm/batch-completions", "/v2/batch-completions"):
            response = api.client.post(route, json=body, headers=ALICE)
            assert response.status_code == 422, (route, response.text)
            (error,) = response.json()["detail"]
            assert error["loc"] == ["body", "model_config", "model"]
            assert "the model cannot be read here" in error["msg"], error
    _nothing_stored(api)

    batch = _create(api.client, _upload(api.client, _jsonl([_line("a", model="no-such-model")])).json()["id"])
    assert batch.status_code == 200 and batch.json()["status"] == "failed", batch.text
    (error,) = batch.json()["errors"]["data"]
    assert (error["code"], error["param"]) == ("model_not_served", "body.model")
    assert "the model cannot be read here" in error["message"]
    assert api.store.list().jobs[0].status == "failed"  # stored failed, as OpenAI's, never launched


def test_a_checkpoint_on_an_object_store_is_read_for_its_tokenizer_and_config_only(
    deployment_factory, tmp_path, tokenizer, s3, monkeypatch
):
    from batch_pipeline.models.catalog import resolve_model

    local = resolve_model(MODEL)
    monkeypatch.setenv("BATCH_PIPELINE_MODEL_CACHE", str(tmp_path / "cache"))
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ):
        s3.upload_file(f"{local}/{name}", "batch", f"models/smol/{name}")
    s3.put_object(Bucket="batch", Key="models/smol/model.safetensors", Body=b"w" * 1000)
    api = deployment_factory()
    model_config = {"model": "smol", "checkpoint_path": "s3://batch/models/smol"}
    answer = _dry_run(
        api, _body(tmp_path, [{"prompt": "The capital of France is", "max_tokens": 3}], model_config=model_config)
    ).json()
    assert answer["prompt_tokens"] == len(tokenizer.encode("The capital of France is")), answer
    assert answer["context_length"] == CONTEXT
    fetched = sorted(path.name for path in (tmp_path / "cache").rglob("*") if path.is_file())
    assert "model.safetensors" not in fetched and "tokenizer.json" in fetched  # no weights for a dry run


# A chat template is the request's own Jinja: these would hold the API process's memory or a thread for as
# long as they ran, had the dry run rendered them there.
TEMPLATE_OF_GIGABYTES = (
    "{% set s = 'a' * 2000000000 %}{{ s | length }}{% for m in messages %}{{ m.content }}{% endfor %}"
)
TEMPLATE_WITHOUT_END = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"


def _chat(template: str) -> dict:
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "chat_template": template}


def test_a_chat_template_building_gigabytes_is_stopped_at_the_dry_runs_memory_and_refused_by_its_index(
    deployment_factory, tmp_path, monkeypatch
):
    monkeypatch.setenv("BATCH_PIPELINE_DRY_RUN_MEMORY_MB", "512")
    api = deployment_factory()
    answer = _dry_run(api, _body(tmp_path, [_chat("{{ messages[0].content }}"), _chat(TEMPLATE_OF_GIGABYTES)]))
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["num_requests"] == 2 and body["num_cannot_run"] == 1
    (refused,) = body["cannot_run"]
    assert refused["index"] == 1 and refused["message"].startswith("chat_template: MemoryError")
    _nothing_stored(api)


def test_a_chat_template_that_does_not_end_stops_the_dry_run_at_its_time_limit(
    deployment_factory, tmp_path, monkeypatch
):
    monkeypatch.setenv("BATCH_PIPELINE_DRY_RUN_TIMEOUT_S", "5")
    api = deployment_factory()
    answer = _dry_run(api, _body(tmp_path, [_chat(TEMPLATE_WITHOUT_END)]))
    assert answer.status_code == 422, answer.text
    assert "the dry run was stopped after 5 s" in answer.text and "content" in answer.text
    # Its slot is free again, and the next dry run is answered.
    assert _dry_run(api, _body(tmp_path, [_chat("{{ messages[0].content }}")])).status_code == 200


def test_the_estimate_learns_generation_rates_and_engine_starts_not_job_walls(tmp_path):
    """Issue 46: after five small jobs an estimate said 11 minutes for 272 tokens that took 1-2: each job's
    tokens over its wall counted its ~55 s engine start as generating."""
    from batch_pipeline.dry_run.counting import Counts
    from batch_pipeline.dry_run.estimate import _runtime
    from batch_pipeline.shards.planning import PlanningSettings
    from batch_pipeline.store.results import CompletedFigures, JobResults

    def job(rate: float, wall_rate: float | None, engine_start_s: float | None = None) -> CompletedFigures:
        results = JobResults(
            completion_tokens=60,
            completion_tokens_per_s=rate,
            completion_tokens_per_wall_s=wall_rate,
            engine_start_s=engine_start_s,
        )
        return CompletedFigures(results=results, shards=1)

    request = CreateBatchCompletionsV2Request.model_validate(
        _body(tmp_path, {"prompts": ["hi"], "max_new_tokens": 4, "temperature": 0.0})
    )
    counts = Counts(requests=1, prompts=1, prompt_tokens=10, output_tokens=272)
    planning = PlanningSettings(max_shards=None, min_tokens_per_shard=0)
    # Four jobs of this release (3 tokens/s while generating, ~55 s engine starts), one older whose figure
    # is its wall's: the older one is not counted.
    history = [job(3.0, 0.5, 55.0), job(3.2, 0.6, 54.0), job(2.8, 0.4, 56.0), job(3.0, 0.5, 55.0), job(0.3, None)]
    estimate = _runtime(request, counts, history, planning)["estimate"]
    assert (estimate.completion_tokens_per_s, estimate.engine_start_s, estimate.from_jobs) == (3.0, 55.0, 4)
    assert estimate.wall_s == pytest.approx(55.0 + 272 / 3.0, abs=0.1)  # ~2.4 minutes, not 11

    # Only older jobs known: their wall rates, as before (no engine start apart).
    older = _runtime(request, counts, [job(0.4, None)], planning)["estimate"]
    assert (older.completion_tokens_per_s, older.engine_start_s, older.wall_s) == (0.4, 0.0, 680.0)


EMBEDDING_MODEL = "all-minilm-l6-v2"


def _embedding_inputs(requests: int) -> list[list[str]]:
    return [[f"sentence {n}-{m} about cats" for m in range(5)] for n in range(requests)]


def _dry_run_batch(api, inputs: list[list[str]]) -> dict:
    """A dry run of an OpenAI batch of /v1/embeddings lines (the Scale routes take no embedding model)."""
    lines = [_embedding_line(f"line-{n}", input=texts) for n, texts in enumerate(inputs)]
    file_id = _upload(api.client, _jsonl(lines)).json()["id"]
    answer = api.client.post(
        "/v1/batches",
        params={"dry_run": "true"},
        json={"input_file_id": file_id, "endpoint": EMBEDDINGS, "completion_window": "24h"},
        headers={"Authorization": f"Bearer {USER_KEY}"},
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_dry_run_of_an_embeddings_batch_estimates_from_its_models_embedding_throughput(deployment_factory, tmp_path):
    """An embedding generates no token: its job's time is its engine start, then its inputs read at the rate
    its model's embeddings jobs read theirs. It was "no history: no completed job ... generated any tokens"
    whatever had run."""
    api = deployment_factory()
    inputs = _embedding_inputs(4)
    assert _dry_run_batch(api, inputs)["no_history"].startswith(f"no history: no job of '{EMBEDDING_MODEL}' has")

    # A job of the model completes (run as the launchpad runs one: the Scale routes take no embedding model).
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"input": texts}) + "\n" for texts in inputs))
    request = CreateBatchCompletionsV2Request.model_validate(
        {
            "input_data_path": str(tmp_path / "in.jsonl"),
            "output_data_path": str(tmp_path / "out.json"),
            "model_config": {"model": EMBEDDING_MODEL},
        }
    )
    result = execute_request(request, api.instance)
    assert result.success, step_failure_messages(result)
    (job,) = api.store.list().jobs
    results = job.results
    assert results.completion_tokens == 0 and results.prompt_tokens_per_s > 0

    same = _dry_run_batch(api, inputs)
    assert same["max_output_tokens"] == 0 and same["prompt_tokens"] == results.prompt_tokens
    estimate = same["estimate"]
    assert estimate["prompt_tokens_per_s"] == pytest.approx(results.prompt_tokens_per_s, abs=0.01)
    assert estimate["completion_tokens_per_s"] is None and estimate["from_jobs"] == 1
    assert estimate["engine_start_s"] == pytest.approx(results.engine_start_s, abs=0.05)
    # The same work is estimated at no more than it took (its wall holds its planning and merge too).
    assert estimate["engine_start_s"] < estimate["wall_s"] <= results.wall_s

    # Ten times the inputs: the engine start once, ten times the reading.
    bigger = _dry_run_batch(api, _embedding_inputs(40))
    rate = bigger["estimate"]["prompt_tokens_per_s"]
    expected = bigger["estimate"]["engine_start_s"] + bigger["prompt_tokens"] / rate
    assert bigger["prompt_tokens"] == pytest.approx(10 * results.prompt_tokens, rel=0.05)
    assert bigger["estimate"]["wall_s"] == pytest.approx(expected, abs=0.1)


def test_the_estimate_of_an_embeddings_job_is_its_inputs_at_the_pooling_rate_not_a_generation_rate(tmp_path):
    from batch_pipeline.dry_run.counting import Counts
    from batch_pipeline.dry_run.estimate import _runtime
    from batch_pipeline.shards.planning import PlanningSettings
    from batch_pipeline.store.results import CompletedFigures, JobResults

    def job(prompt_rate: float | None, engine_start_s: float = 8.0) -> CompletedFigures:
        results = JobResults(
            prompt_tokens=5000,
            completion_tokens=0,
            completion_tokens_per_s=0.0,
            completion_tokens_per_wall_s=0.0,
            engine_start_s=engine_start_s,
            prompt_tokens_per_s=prompt_rate,
        )
        return CompletedFigures(results=results, shards=1)

    request = CreateBatchCompletionsV2Request.model_validate(
        {"output_data_path": str(tmp_path / "o.json"), "model_config": {"model": EMBEDDING_MODEL},
         "input_data_path": str(tmp_path / "in.jsonl")}
    )  # fmt: skip
    counts = Counts(requests=100, prompts=1000, prompt_tokens=100_000, pooled_tokens=100_000)
    planning = PlanningSettings(max_shards=None, min_tokens_per_shard=0)
    history = [job(2000.0), job(1800.0, 9.0), job(2200.0, 7.0), job(None)]  # the last of an older release
    estimate = _runtime(request, counts, history, planning)["estimate"]
    assert (estimate.prompt_tokens_per_s, estimate.completion_tokens_per_s, estimate.from_jobs) == (2000.0, None, 3)
    assert estimate.wall_s == pytest.approx(8.0 + 100_000 / 2000.0, abs=0.1)

    only_older = _runtime(request, counts, [job(None)], planning)
    assert only_older["no_history"] == (
        f"no history: no completed job of '{EMBEDDING_MODEL}' here measured how fast it read its inputs, so there "
        "is no throughput to estimate from"
    )
