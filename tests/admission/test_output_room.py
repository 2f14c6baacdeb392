"""An embeddings job's outputs held to its team's `max_stored_bytes` before any engine starts: an embedding is
large next to its input (a short input is 384 floats of JSON, ~8.5 kB), and nothing bounded it. An OpenAI
batch is refused when its file is checked (OpenAI's 429, naming `input_file_id`, nothing stored); a job
reading an input file fails as its plan reads the file, before a shard starts."""

import hashlib
import json

import pytest

from batch_pipeline.admission.submission import StoredRequest
from batch_pipeline.contract.kinds import EMBEDDING
from batch_pipeline.contract.kinds.embedding import EmbeddingRequest
from batch_pipeline.core.settings import settings
from batch_pipeline.pipeline.execute import execute_request
from batch_pipeline.store.jobs import JobStore
from batch_pipeline.store.schema import JobStatus
from tests.openai_batch.test_openai_batch import EMBEDDING_MODEL, EMBEDDINGS, _create, _embedding_line, _jsonl, _upload
from tests.pipeline.test_launchpad_owner import step_failure_messages

KEY = "key-of-the-embedding-team"
QUOTA = 200_000


@pytest.fixture
def teams(tmp_path, monkeypatch) -> dict:
    """A team whose max_stored_bytes is QUOTA, in the tenants file the deployment reads."""
    root = tmp_path / "team-a"
    root.mkdir()
    tenants_file = tmp_path / "tenants.yaml"
    tenants_file.write_text(
        "tenants:\n"
        "  team-a:\n"
        f"    api_keys_sha256: [{hashlib.sha256(KEY.encode()).hexdigest()}]\n"
        f"    data_roots: [{root}]\n"
        f"    max_stored_bytes: {QUOTA}\n"
    )
    monkeypatch.setenv("BATCH_PIPELINE_TENANTS", str(tenants_file))
    return {"team-a": root}


@pytest.fixture
def api(teams, tenants_api):
    return tenants_api


def test_the_estimate_is_what_the_worker_writes_for_each_encoding():
    """The worker's output entry (worker/embedding_requests.py), for vectors as MiniLM's are (unit length,
    float32): json.dumps of the floats, or base64 of their bytes."""
    import base64

    import numpy as np

    vectors = np.random.default_rng(0).standard_normal((50, 384)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    for encoding in ("float", "base64"):
        request = EmbeddingRequest(input=["a"] * 50, encoding_format=encoding).model_dump(exclude_none=True)
        data = [
            {
                "object": "embedding",
                "index": index,
                "embedding": base64.b64encode(vector.astype("<f4").tobytes()).decode()
                if encoding == "base64"
                else vector.tolist(),
            }
            for index, vector in enumerate(vectors)
        ]
        entry = {"id": "batch-x-0", "object": "list", "data": data, "model": EMBEDDING_MODEL}
        entry["usage"] = {"prompt_tokens": 150, "total_tokens": 150}
        written = len(json.dumps(entry))
        estimate = EMBEDDING.output_bytes(request, 384)
        assert written <= estimate <= 1.05 * written, (encoding, written, estimate)
    # Fewer dimensions asked for are what is written; more are an error entry, and the model's size is the bound.
    inputs = ["a"] * 50
    whole = EMBEDDING.output_bytes({"input": inputs}, 384)
    assert EMBEDDING.output_bytes({"input": inputs, "dimensions": 64}, 384) < whole / 5
    assert EMBEDDING.output_bytes({"input": inputs, "dimensions": 10**9}, 384) == whole


def test_an_embeddings_batch_past_the_teams_room_is_a_429_naming_the_file_and_nothing_is_kept(api, tmp_path):
    lines = [_embedding_line(f"line-{n}", input=f"sentence number {n}") for n in range(10)]
    uploaded = _upload(api, _jsonl(lines), key=KEY)
    assert uploaded.status_code == 200, uploaded.text

    # 10 vectors of 384 floats, ~90 kB, each kept 3 times (checkpoint, sorted output, output file): past 200 kB.
    refused = _create(api, uploaded.json()["id"], key=KEY, endpoint=EMBEDDINGS)
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("rate_limit_exceeded", "input_file_id")
    message = error["message"]
    assert message.startswith("max_stored_bytes: this batch's 10 embedding requests are estimated at ~"), message
    assert f"quota of {QUOTA}" in message and "encoding_format base64" in message
    assert "retry-after" not in refused.headers  # waiting frees nothing
    bearer = {"Authorization": f"Bearer {KEY}"}
    assert api.get("/v1/batches", headers=bearer).json()["data"] == []
    assert api.get("/v2/batch-completions", headers={"x-api-key": KEY}).json()["jobs"] == []
    work = tmp_path / "dagster_home" / "work"
    assert sorted(path.name for path in work.iterdir()) == ["files"]  # no work dir left

    # The same inputs as base64 (a quarter of the bytes) fit, and the batch is made.
    small = [_embedding_line(f"line-{n}", input=f"sentence number {n}", encoding_format="base64") for n in range(10)]
    made = _create(api, _upload(api, _jsonl(small), key=KEY).json()["id"], key=KEY, endpoint=EMBEDDINGS)
    assert made.status_code == 200 and made.json()["status"] == "in_progress", made.text


def test_a_job_reading_an_embeddings_file_past_the_teams_room_fails_at_planning_before_a_shard_starts(
    teams, dagster_home, monkeypatch
):
    monkeypatch.delenv("BATCH_PIPELINE_JOBS_DB", raising=False)  # the store in the test's DAGSTER_HOME
    root = teams["team-a"]
    # 20 records of 5 short inputs: ~850 kB of vectors, kept twice (checkpoint, sorted output), against a
    # quota of 200 kB. The file is the team's own data, a few kB: its size at submission says nothing of them.
    (root / "inputs.jsonl").write_text(
        "".join(json.dumps({"input": [f"text {n}-{m}" for m in range(5)]}) + "\n" for n in range(20))
    )
    job = StoredRequest.model_validate(
        {
            "input_data_path": str(root / "inputs.jsonl"),
            "output_data_path": str(root / "out.json"),
            "model_config": {"model": EMBEDDING_MODEL},
        }
    )
    result = execute_request(job, dagster_home, team="team-a")

    assert not result.success
    [message] = step_failure_messages(result)
    # Refused as soon as what it read passes the room: the third request's.
    assert message.startswith("max_stored_bytes: this job's first 3 embedding requests are estimated at ~"), message
    assert "kept 2 times" in message and f"quota of {QUOTA}" in message
    started = {event.step_key for event in result.all_events if event.event_type_value == "STEP_START"}
    assert started == {"validate_input", "plan_shards"}  # no shard was launched
    [record] = JobStore(settings().job_store_url).list().jobs
    assert record.status == JobStatus.FAILED and record.failure_reason.startswith("max_stored_bytes:")
    assert not (root / "out.json").exists()
