"""The control plane over HTTP: one submission path (nothing of a v1 request lost), lists paged and filtered
in SQL, status read from job rows, and Prometheus metrics of the same rows."""

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import dagster as dg
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batch_pipeline.contract import CreateBatchCompletionsV2Request
from batch_pipeline.core.settings import settings
from batch_pipeline.pipeline import sensors
from batch_pipeline.pipeline.execute import execute_request
from batch_pipeline.pipeline.partial_results import PARTIAL_RESULTS_TAG, keep_partial_results
from batch_pipeline.pipeline.resources import JobStorage
from batch_pipeline.store.progress import ShardProgressStore
from batch_pipeline.store.records import NewJob
from tests.api_fixtures import ADMIN_KEY, OTHER_KEY, USER_KEY, sensor_resources
from tests.conftest import MODEL, step_failure_messages
from tests.openai_batch.test_openai_batch import EMBEDDING_MODEL, EMBEDDINGS, _create, _embedding_line, _jsonl, _upload
from tests.openai_batch.test_openai_batch import _line as _chat_line

ALICE = {"x-api-key": USER_KEY}
BOB = {"x-api-key": OTHER_KEY}
ADMIN = {"x-api-key": ADMIN_KEY}


def _body(tmp_path, **fields):
    return {
        "output_data_path": str(tmp_path / "out" / "output.json"),
        "model_config": {"model": MODEL},
        "content": {"prompts": ["Hello"], "max_new_tokens": 4, "temperature": 0.0},
        **fields,
    }


def test_v1_model_config_labels_are_the_jobs_labels(deployment_factory, tmp_path):
    api = deployment_factory()
    body = _body(tmp_path, labels={"team": "search"})
    body["model_config"]["labels"] = {"project": "atlas", "team": "overridden"}
    job_id = api.client.post("/v1/llm/batch-completions", json=body, headers=ALICE).json()["job_id"]

    labels = json.loads(api.job(job_id)["metadata"]["labels"])
    assert labels == {"project": "atlas", "team": "search"}  # the request's own labels win a clash
    listed = api.client.get("/v2/batch-completions", params={"label": "project:atlas"}, headers=ALICE).json()["jobs"]
    assert [job["job_id"] for job in listed] == [job_id]


def test_lists_are_paged_newest_first_and_filtered_by_status_and_labels(deployment_factory, tmp_path):
    api = deployment_factory()
    made = [
        api.client.post(
            "/v2/batch-completions", json=_body(tmp_path, labels={"n": str(i), "odd": str(i % 2)}), headers=ALICE
        ).json()["job_id"]
        for i in range(5)
    ]
    api.client.post(f"/v2/batch-completions/{made[1]}/actions/cancel", headers=ALICE)

    seen, after = [], None
    while True:
        params = {"limit": 2, **({"after": after} if after else {})}
        page = api.client.get("/v2/batch-completions", params=params, headers=ALICE).json()
        seen.append([job["job_id"] for job in page["jobs"]])
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert seen == [made[4:2:-1], made[2:0:-1], made[:1]]
    queued = api.client.get("/v2/batch-completions", params={"status": "queued", "label": "odd:1"}, headers=ALICE)
    assert [job["job_id"] for job in queued.json()["jobs"]] == [made[3]]
    cancelled = api.client.get("/v2/batch-completions", params={"status": "cancelled"}, headers=ALICE).json()["jobs"]
    assert [job["job_id"] for job in cancelled] == [made[1]]
    # another key's job is no cursor into this key's jobs
    bobs = api.client.post("/v2/batch-completions", json=_body(tmp_path), headers=BOB).json()["job_id"]
    assert api.client.get("/v2/batch-completions", params={"after": bobs}, headers=ALICE).json()["jobs"] == []
    assert api.client.get("/v2/batch-completions", params={"limit": 0}, headers=ALICE).status_code == 422
    assert api.client.get("/v2/batch-completions", params={"limit": 1001}, headers=ALICE).status_code == 422


def _metrics(api, headers=ADMIN) -> dict[str, list]:
    response = api.client.get("/metrics", headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {family.name: family.samples for family in text_string_to_metric_families(response.text)}


def test_metrics_count_jobs_by_status_and_model_and_the_queue_for_admins_only(deployment_factory, tmp_path):
    api = deployment_factory()
    made = [
        api.client.post("/v2/batch-completions", json=_body(tmp_path), headers=ALICE).json()["job_id"] for _ in range(3)
    ]
    api.client.post(f"/v2/batch-completions/{made[0]}/actions/cancel", headers=ALICE)
    api.store.mark_started(made[1], "run-1")  # as the run's first step records it
    ShardProgressStore(engine=api.store.engine).record_shards(made[1], {0: 4})
    ShardProgressStore(engine=api.store.engine).record_shard_progress(
        made[1], 0, {"requests_done": 3, "completion_tokens": 12}
    )

    metrics = _metrics(api)
    jobs = {(s.labels["status"], s.labels["model"]): s.value for s in metrics["batch_pipeline_jobs"]}
    assert jobs == {("cancelled", MODEL): 1, ("running", MODEL): 1, ("queued", MODEL): 1}
    assert [s.value for s in metrics["batch_pipeline_queue_depth"]] == [1]
    assert metrics["batch_pipeline_oldest_queued_job_age_seconds"][0].value >= 0
    assert {
        s.labels["model"]: s.value for s in metrics["batch_pipeline_completion_tokens"] if s.name.endswith("_total")
    } == {MODEL: 12}
    assert {
        s.labels["model"]: s.value for s in metrics["batch_pipeline_requests_generated"] if s.name.endswith("_total")
    } == {MODEL: 3}
    latency = {s.name: s.value for s in metrics["batch_pipeline_job_start_latency_seconds"] if "le" not in s.labels}
    assert latency["batch_pipeline_job_start_latency_seconds_count"] == 1
    assert api.client.get("/metrics", headers=ALICE).status_code == 403


def test_metrics_count_jobs_requests_and_tokens_by_request_kind(deployment_factory, tmp_path):
    """Issue 48: an operator sees embeddings apart from chat. A job's kind is its inline content's or its
    batch's endpoint's from its submission; an input file's is unknown until its plan reads it."""
    api = deployment_factory()
    client = api.client
    v1 = client.post("/v2/batch-completions", json=_body(tmp_path), headers=ALICE).json()["job_id"]
    chat_content = [{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}]
    chat = client.post("/v2/batch-completions", json=_body(tmp_path, content=chat_content), headers=ALICE)
    embedded = _upload(client, _jsonl([_embedding_line("a", input=["x", "y"])]), key=USER_KEY).json()["id"]
    embeddings = _create(client, embedded, key=USER_KEY, endpoint=EMBEDDINGS).json()["id"]
    chatted = _upload(client, _jsonl([_chat_line("a")]), key=USER_KEY).json()["id"]
    chat_batch = _create(client, chatted, key=USER_KEY).json()["id"]
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "Hello", "max_tokens": 4}) + "\n")
    from_file = client.post(
        "/v2/batch-completions",
        json={**_body(tmp_path), "content": None, "input_data_path": str(tmp_path / "in.jsonl")},
        headers=ALICE,
    )
    assert chat.status_code == from_file.status_code == 200, (chat.text, from_file.text)
    progress = ShardProgressStore(engine=api.store.engine)
    for job_id, figures in [
        (embeddings, {"requests_done": 1, "prompt_tokens": 6}),
        (chat_batch, {"requests_done": 1, "prompt_tokens": 9, "completion_tokens": 4}),
        (v1, {"requests_done": 1, "prompt_tokens": 2, "completion_tokens": 3}),
    ]:
        api.store.mark_started(job_id, f"run-{job_id}")
        progress.record_shards(job_id, {0: 1})
        progress.record_shard_progress(job_id, 0, figures)

    metrics = _metrics(api)
    jobs = {(s.labels["status"], s.labels["model"], s.labels["kind"]): s.value for s in metrics["batch_pipeline_jobs"]}
    assert jobs == {
        ("running", MODEL, "v1"): 1,
        ("queued", MODEL, "chat"): 1,  # inline content
        ("running", EMBEDDING_MODEL, "embeddings"): 1,
        ("running", MODEL, "chat"): 1,  # the chat batch
        ("queued", MODEL, "unknown"): 1,  # an input file, not planned yet
    }

    def by_kind(name: str) -> dict[tuple[str, str], float]:
        return {(s.labels["model"], s.labels["kind"]): s.value for s in metrics[name] if s.name.endswith("_total")}

    assert by_kind("batch_pipeline_requests_generated") == {
        (MODEL, "v1"): 1,
        (MODEL, "chat"): 1,
        (EMBEDDING_MODEL, "embeddings"): 1,
        (MODEL, "unknown"): 0,
    }
    assert by_kind("batch_pipeline_prompt_tokens")[EMBEDDING_MODEL, "embeddings"] == 6
    assert by_kind("batch_pipeline_prompt_tokens")[MODEL, "chat"] == 9
    assert by_kind("batch_pipeline_completion_tokens")[EMBEDDING_MODEL, "embeddings"] == 0

    # The plan records an input file's kind as it reads it (plan_shards' record_shards).
    progress.record_shards(from_file.json()["job_id"], {0: 1}, request_kind="completion")
    jobs = {(s.labels["status"], s.labels["kind"]) for s in _metrics(api)["batch_pipeline_jobs"]}
    assert ("queued", "completion") in jobs and ("queued", "unknown") not in jobs


@pytest.mark.slow  # embeds on the catalog's embedding model (a vLLM engine)
def test_an_embeddings_input_file_is_counted_as_embeddings_once_its_plan_has_read_it(deployment_factory, tmp_path):
    api = deployment_factory()
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"input": text}) + "\n" for text in ["a cat", "a dog", "x"]))
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

    metrics = _metrics(api)
    jobs = {(s.labels["status"], s.labels["model"], s.labels["kind"]): s.value for s in metrics["batch_pipeline_jobs"]}
    assert jobs == {("completed", EMBEDDING_MODEL, "embeddings"): 1}
    embedded = [s.value for s in metrics["batch_pipeline_prompt_tokens"] if s.labels["kind"] == "embeddings"]
    assert embedded == [job.prompt_tokens] and job.prompt_tokens > 0
    requests = [s.value for s in metrics["batch_pipeline_requests_generated"] if s.name.endswith("_total")]
    assert requests == [3]


def test_a_stopped_runs_partial_results_are_kept_by_a_job_not_a_sensor(deployment_factory, tmp_path):
    """keep_partial_results, run as the run-status sensors launch it: the finished results in input order,
    the rest error entries, the counts in the job's row."""
    api = deployment_factory()
    output = tmp_path / "out" / "output.json"
    job_id = api.client.post("/v2/batch-completions", json=_body(tmp_path), headers=ALICE).json()["job_id"]
    stopped = api.instance.add_run(dg.DagsterRun(job_name="batch_completions", status=dg.DagsterRunStatus.CANCELED))
    api.store.mark_started(job_id, stopped.run_id)
    work_dir = JobStorage(work_dir_base=settings().work_dir_base).work_dir(job_id)
    for shard, (items, results) in enumerate([([0, 2], {0: "a"}), ([1], {1: "b"})]):
        directory = Path(work_dir) / "shards" / f"{shard:03d}"  # as plan_shards and a worker leave them
        directory.mkdir(parents=True)
        (directory / "input.jsonl").write_text(
            "".join(json.dumps({"index": i, "kind": "v1", "request": {}}) + "\n" for i in items)
        )
        (directory / "results.tsv").write_text(
            "".join(f"{i}\t{json.dumps({'text': text})}\n" for i, text in results.items())
        )
    ShardProgressStore(engine=api.store.engine).record_shards(job_id, {0: 2, 1: 1})

    result = keep_partial_results.execute_in_process(
        run_config={
            "ops": {
                "merge_finished_results": {
                    "config": {"job_id": job_id, "run_id": stopped.run_id, "code": "cancelled", "reason": "stopped"}
                }
            }
        },
        instance=api.instance,
        resources=sensor_resources(
            str(api.store.engine.url), job_storage=JobStorage(work_dir_base=settings().work_dir_base)
        ),
    )
    assert result.success
    assert json.loads(output.read_text()) == [
        {"text": "a"},
        {"text": "b"},
        {"error": {"message": "stopped", "type": "server_error", "param": None, "code": "cancelled"}},
    ]
    metadata = api.job(job_id)["metadata"]
    assert (metadata["num_requests"], metadata["num_finished"], metadata["num_unfinished"]) == ("3", "2", "1")
    assert api.instance.get_run_by_id(stopped.run_id).tags[PARTIAL_RESULTS_TAG] == "2/3"


@dg.op
def _succeed() -> None:
    pass


@dg.op
def _fail() -> None:
    raise dg.Failure("the disk is full")


@dg.job
def _finishes():
    _succeed()


@dg.job
def _breaks():
    _fail()


def test_rows_an_older_release_left_running_are_set_from_their_finished_runs_by_the_jobs_sensor(
    deployment_factory, monkeypatch
):
    """Migration 0003 reads a row with a run as running; its run may have ended long ago."""
    api = deployment_factory()
    monkeypatch.setattr(sensors, "RECONCILE_AFTER_S", 0)
    finished = _finishes.execute_in_process(instance=api.instance).run_id
    failed = _breaks.execute_in_process(instance=api.instance, raise_on_error=False).run_id
    for job_id, run_id in (("batch-legacy-finished", finished), ("batch-legacy-failed", failed)):
        api.store.create(
            NewJob(
                job_id=job_id,
                owner="legacy",
                request_json=json.dumps(_body_stored()),
                request_sha256="0" * 64,
                model=MODEL,
                priority=None,
                labels={},
                max_runtime_sec=60,
            )
        )
        api.store.mark_started(job_id, run_id)
    context = dg.build_sensor_context(instance=api.instance, resources=sensor_resources(str(api.store.engine.url)))
    assert list(sensors.batch_jobs_sensor(interval_s=1)(context) or []) == []

    assert api.job("batch-legacy-finished", ADMIN_KEY)["status"] == "completed"
    failure = api.job("batch-legacy-failed", ADMIN_KEY)
    assert failure["status"] == "failed" and failure["metadata"]["failure_reason"] == "the disk is full"
    assert failure["completed_at"] is not None


def _body_stored() -> dict:
    return {"output_data_path": "/tmp/legacy.json", "model_config": {"model": MODEL}, "input_data_path": "/tmp/in.json"}


@pytest.mark.slow
def test_two_60_mb_inline_jobs_submitted_together_both_complete(deployment_factory, tmp_path):
    """Inline content is written to the job's work dir at submission: runs, ticks and rows stay small, and
    two such jobs at once (a 120 MB tick before) run side by side."""
    api = deployment_factory(max_concurrent_runs=2)
    url = api.serve_http()
    api.start_daemon()
    # 600 prompts of 100 KB: each longer than the model's context, so vLLM refuses it at once (an error
    # entry at its index) instead of spending minutes of CPU on it; a real prompt at each end.
    filler = "word " * 20_000
    prompts = ["The capital of France is"] + [filler] * 600 + ["1, 2, 3, 4,"]

    def post(name: str) -> str:
        body = {
            "output_data_path": str(tmp_path / f"{name}.json"),
            "model_config": {"model": MODEL},
            "content": {"prompts": prompts, "max_new_tokens": 4, "temperature": 0.0},
        }
        raw = json.dumps(body).encode()
        assert len(raw) > 60_000_000
        response = httpx.post(
            f"{url}/v1/llm/batch-completions",
            content=raw,
            timeout=300,
            headers={**ALICE, "content-type": "application/json"},
        )
        assert response.status_code == 200, response.text
        return response.json()["job_id"]

    with ThreadPoolExecutor(2) as pool:
        job_ids = list(pool.map(post, ["first", "second"]))
    for job_id in job_ids:
        assert len(api.store.get(job_id).request_json) < 4096
    for job_id, name in zip(job_ids, ["first", "second"]):
        job = api.wait_for(job_id, lambda j: j["status"] in ("completed", "failed", "cancelled"), timeout=900)
        assert job["status"] == "completed", job
        assert (job["metadata"]["num_requests"], job["metadata"]["num_errors"]) == ("602", "600")
        outputs = json.loads((tmp_path / f"{name}.json").read_text())
        assert len(outputs) == 602 and outputs[0]["num_completion_tokens"] > 0 < outputs[-1]["num_completion_tokens"]
        assert all("error" in output for output in outputs[1:-1])
    assert os.path.exists(api.store.get(job_ids[0]).content_path)


def test_a_jobs_status_says_its_phase_from_queued_through_starting_engine_and_generating_to_merging(
    deployment_factory, tmp_path
):
    """Issue 46: a job read `running`, 0 done, for the ~55 s its engine took to start. Its phase is read from
    its row as the run's steps and the shard workers' Pipes reports write it."""
    api = deployment_factory()
    job_id = api.client.post("/v2/batch-completions", json=_body(tmp_path), headers=ALICE).json()["job_id"]
    progress = ShardProgressStore(engine=api.store.engine)

    def phase() -> str | None:
        return api.job(job_id)["metadata"].get("phase")

    assert phase() == "queued"
    api.store.mark_started(job_id, "run-1")  # validate_input
    assert phase() == "planning shards"
    progress.record_shards(job_id, {0: 4, 1: 2})  # plan_shards
    assert phase() == "starting workers"
    progress.record_shard_charge(job_id, 0, 1.0)  # run_shard starts shard 0's worker
    progress.record_shard_progress(job_id, 0, {"requests_done": 0})  # its first report, before its engine
    assert phase() == "starting workers"
    progress.record_shard_progress(job_id, 0, {"engine_starting": 1})  # just before it builds its engine
    assert phase() == "starting engine"
    progress.record_shard_progress(job_id, 0, {"requests_done": 3, "completion_tokens": 12})
    assert phase() == "generating 3/6"
    progress.record_shard_charge(job_id, 1, 1.0)  # another shard starting does not take the job back
    progress.record_shard_progress(job_id, 1, {"engine_starting": 1})
    assert phase() == "generating 3/6"
    progress.record_shard_progress(job_id, 0, {"requests_done": 4})
    progress.record_shard_progress(job_id, 1, {"requests_done": 2})
    assert phase() == "merging"  # every shard done: write_output merges them
    api.store.mark_cancelled(job_id)  # as a cancel records it, having asked Dagster to stop the run
    assert (api.job(job_id)["status"], phase()) == ("running", "stopping")
