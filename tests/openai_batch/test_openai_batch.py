"""OpenAI's Batch API over HTTP (the real app, store and Dagster instance): files, batch validation as
OpenAI does it, ownership, OpenAI's error bodies, cancelling before launch. The end-to-end run with the
official `openai` SDK against `make serve` is in test_openai_sdk_e2e.py."""

import json
import time
from datetime import UTC

import pytest

from tests.api_fixtures import ADMIN_KEY, OTHER_KEY, USER_KEY
from tests.conftest import MODEL

CHAT = "/v1/chat/completions"


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _line(custom_id: str, content: str = "Say hi", model: str = MODEL, url: str = CHAT, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": url,
        "body": {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **body},
    }


def _jsonl(lines: list) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def _upload(client, data: bytes, key: str = USER_KEY, purpose: str = "batch", filename: str = "in.jsonl"):
    return client.post(
        "/v1/files",
        headers=_bearer(key),
        data={"purpose": purpose},
        files={"file": (filename, data, "application/jsonl")},
    )


def _create(client, file_id: str, key: str = USER_KEY, endpoint: str = CHAT, **fields):
    body = {"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h", **fields}
    return client.post("/v1/batches", headers=_bearer(key), json=body)


@pytest.fixture
def deployment(deployment_factory):
    return deployment_factory()


def test_files_are_stored_listed_read_and_deleted_by_their_owner_only(deployment):
    client = deployment.client
    data = _jsonl([_line("a"), _line("b")])
    # A file name is stored as text any database holds (a raw multipart body: httpx would escape these).
    raw = (
        b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--B\r\nContent-Disposition: '
        b'form-data; name="file"; filename="x\x00\x1b\xed\xa0\x80.jsonl"\r\n\r\n' + data + b"\r\n--B--\r\n"
    )
    odd = client.post(
        "/v1/files", content=raw, headers={**_bearer(USER_KEY), "content-type": "multipart/form-data; boundary=B"}
    )
    assert odd.status_code == 200 and odd.json()["filename"].startswith("x") and "\x00" not in odd.json()["filename"]
    client.delete(f"/v1/files/{odd.json()['id']}", headers=_bearer(USER_KEY))
    uploaded = _upload(client, data, filename="prompts.jsonl")
    assert uploaded.status_code == 200, uploaded.text
    file = uploaded.json()
    assert file["object"] == "file" and file["purpose"] == "batch" and file["filename"] == "prompts.jsonl"
    assert file["bytes"] == len(data) and file["id"].startswith("file-")

    assert client.get(f"/v1/files/{file['id']}", headers=_bearer(USER_KEY)).json() == file
    content = client.get(f"/v1/files/{file['id']}/content", headers=_bearer(USER_KEY))
    assert content.status_code == 200 and content.content == data
    assert [f["id"] for f in client.get("/v1/files", headers=_bearer(USER_KEY)).json()["data"]] == [file["id"]]

    # Another tenant sees nothing of it: absent, in OpenAI's error shape; an admin sees it.
    assert client.get("/v1/files", headers=_bearer(OTHER_KEY)).json()["data"] == []
    for method, path in (
        ("GET", f"/v1/files/{file['id']}"),
        ("GET", f"/v1/files/{file['id']}/content"),
        ("DELETE", f"/v1/files/{file['id']}"),
    ):
        refused = client.request(method, path, headers=_bearer(OTHER_KEY))
        assert refused.status_code == 404
        assert refused.json()["error"]["type"] == "invalid_request_error"
        assert file["id"] in refused.json()["error"]["message"]
    assert client.get(f"/v1/files/{file['id']}", headers=_bearer(ADMIN_KEY)).status_code == 200

    deleted = client.delete(f"/v1/files/{file['id']}", headers=_bearer(USER_KEY))
    assert deleted.json() == {"id": file["id"], "object": "file", "deleted": True}
    assert client.get(f"/v1/files/{file['id']}", headers=_bearer(USER_KEY)).status_code == 404
    assert not any((deployment.home / "work" / "files").iterdir())


def test_uploads_are_refused_without_a_key_a_batch_purpose_or_within_the_size_limit(deployment, monkeypatch):
    client = deployment.client
    anonymous = client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("a.jsonl", b"{}\n")})
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["type"] == "authentication_error"
    wrong_key = _upload(client, b"{}\n", key="not-a-key")
    assert wrong_key.status_code == 401

    purpose = _upload(client, b"{}\n", purpose="fine-tune")
    assert purpose.status_code == 400 and purpose.json()["error"]["param"] == "purpose"
    no_file = client.post("/v1/files", headers=_bearer(USER_KEY), data={"purpose": "batch"})
    assert no_file.status_code == 400 and no_file.json()["error"]["param"] == "file"
    empty = _upload(client, b"")
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "file"


def test_an_upload_over_the_file_limit_is_refused_and_nothing_is_kept(deployment_factory, monkeypatch):
    monkeypatch.setenv("BATCH_PIPELINE_MAX_FILE_BYTES", str(1024 * 1024))
    client = deployment_factory().client
    assert _upload(client, b"x" * (900 * 1024)).status_code == 200  # under the limit, over no other
    too_large = _upload(client, b"x" * (2 * 1024 * 1024))
    assert too_large.status_code == 413
    assert len(client.get("/v1/files", headers=_bearer(USER_KEY)).json()["data"]) == 1


def test_each_router_answers_its_errors_in_its_own_shape_whatever_the_error(deployment):
    client = deployment.client
    # An invalid query parameter: OpenAI's 400 naming it, Scale's 422 naming its location.
    bad_limit = client.get("/v1/batches?limit=0", headers=_bearer(USER_KEY))
    assert bad_limit.status_code == 400
    assert (
        bad_limit.json()["error"]["param"] == "limit" and bad_limit.json()["error"]["type"] == "invalid_request_error"
    )
    scale_limit = client.get("/v2/batch-completions?limit=0", headers=_bearer(USER_KEY))
    assert scale_limit.status_code == 422 and scale_limit.json()["detail"][0]["loc"] == ["query", "limit"]
    # A method the route does not take (no handler of the route runs): still the route's own shape.
    wrong_method = client.delete("/v1/batches", headers=_bearer(USER_KEY))
    assert wrong_method.status_code == 405
    assert wrong_method.json() == {
        "error": {"message": "Method Not Allowed", "type": "invalid_request_error", "param": None, "code": None}
    }
    assert client.delete("/v2/batch-completions", headers=_bearer(USER_KEY)).json() == {"detail": "Method Not Allowed"}
    # No key: OpenAI's authentication error, Scale's detail.
    assert client.get("/v1/batches").json()["error"]["type"] == "authentication_error"
    anonymous = client.get("/v2/batch-completions")
    assert anonymous.status_code == 401 and set(anonymous.json()) == {"detail"}


def test_a_file_that_does_not_validate_fails_its_batch_with_each_error_and_its_line(deployment):
    client = deployment.client
    lines = [
        _line("ok-1"),
        "{not json",
        _line("ok-1", "again"),  # the custom_id of line 1
        _line("other-url", url="/v1/completions"),
        _line("other-model", model="another-model"),
        {"custom_id": "no-body", "method": "POST", "url": CHAT},
        _line("bad-body", temperature=9),
        {**_line("get"), "method": "GET"},
    ]
    file_id = _upload(client, _jsonl(lines)).json()["id"]
    created = _create(client, file_id, metadata={"team": "ml"})
    assert created.status_code == 200, created.text
    batch = created.json()
    assert batch["object"] == "batch" and batch["status"] == "failed" and batch["failed_at"] is not None
    errors = {(error["line"], error["code"], error["param"]) for error in batch["errors"]["data"]}
    assert errors == {
        (2, "invalid_json_line", None),
        (3, "duplicate_custom_id", "custom_id"),
        (4, "mismatched_url", "url"),
        (5, "mismatched_model", "body.model"),
        (6, "invalid_request", "body"),
        (7, "invalid_request", "body.temperature"),
        (8, "invalid_request", "method"),
    }
    assert batch["request_counts"] == {"total": 8, "completed": 0, "failed": 0}
    assert batch["metadata"] == {"team": "ml"}

    # The same job store: the batch is a failed job, saying why, and no run was ever made for it.
    job = deployment.job(batch["id"])
    assert job["status"] == "failed" and "line 2" in job["metadata"]["failure_reason"]
    assert "dagster_run_id" not in job["metadata"]
    assert client.get(f"/v1/batches/{batch['id']}", headers=_bearer(USER_KEY)).json() == batch


def test_a_batch_names_an_input_file_of_its_own_owner_and_a_model_this_deployment_serves(
    deployment_factory, tmp_path, monkeypatch
):
    monkeypatch.setenv("BATCH_PIPELINE_DATA_ROOTS", str(tmp_path / "data"))
    deployment = deployment_factory()
    client = deployment.client
    file_id = _upload(client, _jsonl([_line("a")])).json()["id"]
    # Another team's file and one that never was are the 404 a GET of them answers, as OpenAI's.
    for unknown, key in ((file_id, OTHER_KEY), ("file-none", USER_KEY)):
        created = _create(client, unknown, key=key)
        fetched = client.get(f"/v1/files/{unknown}", headers=_bearer(key))
        assert created.status_code == fetched.status_code == 404, created.text
        assert created.json()["error"]["param"] == "input_file_id"
        assert (
            created.json()["error"]["message"]
            == fetched.json()["error"]["message"]
            == f"No such File object: '{unknown}'"
        )
    endpoint = _create(client, file_id, endpoint="/v1/moderations")
    assert endpoint.status_code == 400 and endpoint.json()["error"]["param"] == "endpoint"
    window = _create(client, file_id, completion_window="72h")
    assert window.status_code == 400 and window.json()["error"]["param"] == "completion_window"
    lost = _upload(client, _jsonl([_line("a")])).json()["id"]
    (deployment.home / "work" / "files" / lost).unlink()  # its bytes lost from storage, its row still there
    gone = _create(client, lost)
    assert gone.status_code == 400 and gone.json()["error"]["param"] == "input_file_id"

    # A model path outside the data roots is refused like model_config.model of a v2 request.
    path_file = _upload(client, _jsonl([_line("a", model="/etc/models/secret")])).json()["id"]
    refused = _create(client, path_file).json()
    assert refused["status"] == "failed"
    assert [(e["code"], e["param"]) for e in refused["errors"]["data"]] == [("model_not_served", "body.model")]
    assert "outside the data roots" in refused["errors"]["data"][0]["message"]
    # A catalog model misspelled fails the batch at once, naming it, not after an engine searched the hub.
    typo = _create(client, _upload(client, _jsonl([_line("a", model="smollm2-135m")])).json()["id"]).json()
    assert typo["status"] == "failed"
    assert [(e["code"], e["param"]) for e in typo["errors"]["data"]] == [("model_not_served", "body.model")]
    assert "did you mean 'smollm2-135m-instruct'" in typo["errors"]["data"][0]["message"]


def test_a_valid_batch_is_queued_as_a_job_outside_the_data_roots_and_cancelled_before_launch_lists_every_request(
    deployment_factory, tmp_path, monkeypatch
):
    # The batch's content and output live in its job's work dir, which the data roots need not hold.
    monkeypatch.setenv("BATCH_PIPELINE_DATA_ROOTS", str(tmp_path / "data"))
    deployment = deployment_factory()
    client = deployment.client
    file_id = _upload(client, _jsonl([_line(f"req-{i}", f"prompt {i}") for i in range(3)])).json()["id"]
    batch = _create(client, file_id, metadata={"run": "nightly"}).json()
    assert batch["status"] == "in_progress" and batch["errors"] is None, batch
    assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 0}
    assert batch["expires_at"] == batch["created_at"] + 24 * 3600
    job = deployment.job(batch["id"])
    assert job["status"] == "queued" and job["model_config"]["model"] == MODEL
    assert job["metadata"]["labels"] == json.dumps({"run": "nightly"})

    listed = client.get("/v1/batches", headers=_bearer(USER_KEY)).json()
    assert [b["id"] for b in listed["data"]] == [batch["id"]] and listed["has_more"] is False
    assert client.get("/v1/batches", headers=_bearer(OTHER_KEY)).json()["data"] == []
    assert client.get(f"/v1/batches/{batch['id']}", headers=_bearer(OTHER_KEY)).status_code == 404
    assert client.post(f"/v1/batches/{batch['id']}/cancel", headers=_bearer(OTHER_KEY)).status_code == 404

    cancelled = client.post(f"/v1/batches/{batch['id']}/cancel", headers=_bearer(USER_KEY)).json()
    assert cancelled["status"] == "cancelled" and cancelled["cancelled_at"] is not None
    assert cancelled["output_file_id"] is None and cancelled["error_file_id"] is not None
    assert cancelled["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    error_file = client.get(f"/v1/files/{cancelled['error_file_id']}/content", headers=_bearer(USER_KEY))
    lines = [json.loads(line) for line in error_file.text.splitlines()]
    assert [line["custom_id"] for line in lines] == ["req-0", "req-1", "req-2"]
    assert {line["error"]["code"] for line in lines} == {"batch_cancelled"}
    assert all(line["response"] is None for line in lines)
    assert deployment.job(batch["id"])["status"] == "cancelled"
    again = client.post(f"/v1/batches/{batch['id']}/cancel", headers=_bearer(USER_KEY))
    assert again.status_code == 200 and again.json()["error_file_id"] == cancelled["error_file_id"]


def test_batches_page_newest_first(deployment):
    client = deployment.client
    file_id = _upload(client, _jsonl([_line("a")])).json()["id"]
    made = [_create(client, file_id).json()["id"] for _ in range(3)]
    first = client.get("/v1/batches", headers=_bearer(USER_KEY), params={"limit": 2}).json()
    assert [b["id"] for b in first["data"]] == made[::-1][:2] and first["has_more"] is True
    second = client.get("/v1/batches", headers=_bearer(USER_KEY), params={"limit": 2, "after": first["last_id"]}).json()
    assert [b["id"] for b in second["data"]] == [made[0]] and second["has_more"] is False


EMBEDDINGS = "/v1/embeddings"
EMBEDDING_MODEL = "all-minilm-l6-v2"


def _embedding_line(custom_id: str, model: str = EMBEDDING_MODEL, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": EMBEDDINGS, "body": {"model": model, **body}}


def test_an_embeddings_file_is_checked_as_openai_checks_it_each_hostile_line_naming_its_field(deployment):
    client = deployment.client
    lines = [
        _embedding_line("ok", input="a sentence"),
        _embedding_line("too-many", input=["x"] * 2049),  # OpenAI's bound: 2048 inputs a request
        _embedding_line("negative-id", input=[101, -5, 102]),
        _embedding_line("zero-dimensions", input="x", dimensions=0),
        _embedding_line("empty", input=""),
        _embedding_line("format", input="x", encoding_format="bytes"),
        _embedding_line("no-input"),
        # OpenAI's 300,000 tokens a request, all its inputs together: 37 arrays of 8135 ids.
        _embedding_line("too-many-ids", input=[[101] * 8135] * 37),
        # 400,000 inputs: past what any embeddings request may hold, refused before the line is parsed.
        _embedding_line("huge-array", input=["x"] * 400_000),
    ]
    batch = _create(client, _upload(client, _jsonl(lines)).json()["id"], endpoint=EMBEDDINGS).json()
    assert batch["status"] == "failed"
    errors = {
        (error["line"], error["code"], tuple((error["param"] or "").split(".")[:2]))
        for error in batch["errors"]["data"]
    }
    assert errors == {
        (2, "invalid_request", ("body", "input")),
        (3, "invalid_request", ("body", "input")),
        (4, "invalid_request", ("body", "dimensions")),
        (5, "invalid_request", ("body", "input")),
        (6, "invalid_request", ("body", "encoding_format")),
        (7, "invalid_request", ("body", "input")),
        (8, "invalid_request", ("body", "input")),
        (9, "invalid_request", ("body", "input")),
    }
    by_line = {error["line"]: error["message"] for error in batch["errors"]["data"]}
    assert "300995 token ids" in by_line[8] and "at most 300000" in by_line[8]
    assert "more than 302120 JSON values" in by_line[9]


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        (EMBEDDINGS, {"input": ["ab"] * 3_000_000}),  # 15 MB of strings
        (EMBEDDINGS, {"input": [[30_000] * 2000] * 1000}),  # 12 MB of token ids
        (CHAT, {"messages": [{"role": "user", "content": "a"}] * 200_000}),
        ("/v1/completions", {"prompt": [[1, 2, 3, 4, 5, 6, 7, 8, 9]] * 60_000}),
    ],
    ids=["strings", "token-ids", "messages", "prompt-ids"],
)
def test_a_line_of_millions_of_values_is_refused_naming_its_field_without_being_built(tmp_path, endpoint, body):
    """pydantic builds a line's every value before it checks a bound: the check of one 15 MB line of short
    strings held 900 MB (of Python objects alone), 12 MB of token ids 116 MB; each is refused, naming its
    field, holding about the line itself."""
    import tracemalloc

    from batch_pipeline.openai_batch.jobs import check_input_file

    field = next(iter(body))
    source = tmp_path / "in.jsonl"
    source.write_bytes(_jsonl([{"custom_id": "a", "method": "POST", "url": endpoint, "body": {"model": "m", **body}}]))
    tracemalloc.start()
    try:
        checked = check_input_file(str(source), endpoint, str(tmp_path), max_requests=10)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    [error] = checked.errors
    assert (error.line, error.code, error.param) == (1, "invalid_request", f"body.{field}")
    assert peak < 3 * source.stat().st_size, (peak, source.stat().st_size)


def test_a_model_that_cannot_serve_the_endpoint_fails_its_batch_naming_the_line(deployment):
    client = deployment.client
    # The chat model asked to embed, the embedding model asked to chat or complete: refused, not run.
    for endpoint, line in [
        (EMBEDDINGS, _embedding_line("embed", model=MODEL, input="x")),
        (CHAT, _line("chat", model=EMBEDDING_MODEL)),
        (
            "/v1/completions",
            {
                **_line("complete", model=EMBEDDING_MODEL, url="/v1/completions"),
                "body": {"model": EMBEDDING_MODEL, "prompt": "x"},
            },
        ),
    ]:
        batch = _create(client, _upload(client, _jsonl([line])).json()["id"], endpoint=endpoint).json()
        assert batch["status"] == "failed", batch
        [error] = batch["errors"]["data"]
        assert (error["line"], error["code"], error["param"]) == (1, "model_not_supported", "body.model")
        assert endpoint in error["message"]

    valid = _create(
        client, _upload(client, _jsonl([_embedding_line("a", input=["x", "y"])])).json()["id"], endpoint=EMBEDDINGS
    )
    assert valid.json()["status"] in ("validating", "in_progress"), valid.text


@pytest.mark.slow
def test_a_batch_cancelled_while_running_keeps_what_finished_in_its_output_file(
    deployment_factory, tmp_path, monkeypatch
):
    # The batch's files are in its job's work dir, outside these roots: its run still reads and writes them.
    monkeypatch.setenv("BATCH_PIPELINE_DATA_ROOTS", str(tmp_path / "data"))
    api = deployment_factory()
    api.start_daemon()
    client = api.client
    short = [_line(f"short-{i}", f"Short {i}:", max_tokens=2, temperature=0) for i in range(8)]
    long = [_line(f"long-{i}", f"Long {i}:", max_tokens=3000, ignore_eos=True, temperature=0) for i in range(8)]
    file_id = _upload(client, _jsonl(short + long)).json()["id"]
    batch_id = _create(client, file_id).json()["id"]
    running = api.wait_for(batch_id, lambda j: int(j["metadata"].get("requests_done", "0")) >= 8, timeout=400)
    assert running["status"] == "running"

    cancelling = client.post(f"/v1/batches/{batch_id}/cancel", headers=_bearer(USER_KEY)).json()
    assert cancelling["status"] in ("cancelling", "cancelled") and cancelling["cancelling_at"] is not None
    deadline = time.monotonic() + 180
    while (batch := client.get(f"/v1/batches/{batch_id}", headers=_bearer(USER_KEY)).json())["status"] != "cancelled":
        assert batch["status"] == "cancelling" and time.monotonic() < deadline, batch
        time.sleep(1)
    counts = batch["request_counts"]
    assert counts["total"] == 16 and counts["completed"] >= 8 and counts["completed"] + counts["failed"] == 16

    def lines(file_id: str) -> list[dict]:
        text = client.get(f"/v1/files/{file_id}/content", headers=_bearer(USER_KEY)).text
        return [json.loads(line) for line in text.splitlines()]

    answered = lines(batch["output_file_id"])
    assert {line["custom_id"] for line in answered} >= {f"short-{i}" for i in range(8)}
    assert all(line["response"]["body"]["object"] == "chat.completion" for line in answered)
    unfinished = lines(batch["error_file_id"])
    assert len(answered) + len(unfinished) == 16 and unfinished
    assert {line["error"]["code"] for line in unfinished} == {"batch_cancelled"}
    assert {line["custom_id"] for line in unfinished} <= {f"long-{i}" for i in range(8)}


def test_a_batch_past_its_window_reads_expired_and_its_unreached_requests_say_so(tmp_path):
    from datetime import datetime, timedelta

    from batch_pipeline.api.openai_service import describe_batch
    from batch_pipeline.openai_batch.jobs import expired, write_result_files
    from batch_pipeline.store.openai import BatchRecord
    from batch_pipeline.store.records import JobRecord
    from batch_pipeline.store.schema import JobStatus

    created = datetime(2026, 1, 1, tzinfo=UTC)
    job = JobRecord(
        job_id="batch-1",
        owner="o",
        request_json="{}",
        priority=None,
        labels={},
        created_at=created,
        expires_at=created + timedelta(hours=1),
        run_id="r",
        cancelled_at=None,
        idempotency_key=None,
        status=JobStatus.FAILED,
        completed_at=created + timedelta(hours=1, seconds=30),
        failure_reason="Run timed out",
        requests_total=3,
        requests_done=1,
    )
    assert expired(job)
    assert not expired(JobRecord(**{**job.__dict__, "completed_at": created + timedelta(minutes=5)}))
    batch = BatchRecord(
        batch_id="batch-1",
        owner="o",
        endpoint=CHAT,
        input_file_id="file-1",
        completion_window="1h",
        created_at=created,
        total=3,
    )
    described = describe_batch(batch, job)
    assert described.status == "expired" and described.expired_at == int(job.completed_at.timestamp())

    custom_ids = tmp_path / "custom_ids.jsonl"
    custom_ids.write_text('"a"\n"b"\n"c"\n')
    entries = [
        {"id": "chatcmpl-1", "object": "chat.completion", "choices": []},
        {
            "error": {
                "message": "too long",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "prompt_too_long",
            }
        },
        {"error": {"code": "job_failed", "message": "the job failed before this request finished"}},
    ]
    results = write_result_files("batch-1", "o", str(custom_ids), entries, str(tmp_path / "files"), expired=True)
    assert (results.completed, results.failed) == (1, 2)
    [ok] = [json.loads(line) for line in open(results.output_file.path)]
    assert ok["custom_id"] == "a" and ok["response"] == {
        "status_code": 200,
        "request_id": "chatcmpl-1",
        "body": entries[0],
    }
    refused, unreached = [json.loads(line) for line in open(results.error_file.path)]
    assert refused["response"]["status_code"] == 400 and refused["response"]["body"] == {"error": entries[1]["error"]}
    assert refused["error"] == {"code": "prompt_too_long", "message": "too long"}
    assert unreached["custom_id"] == "c" and unreached["response"] is None
    assert unreached["error"]["code"] == "batch_expired"


@pytest.mark.slow  # its checking process imports vLLM
def test_a_dry_run_of_a_batch_checks_and_tokenizes_its_file_and_creates_nothing(deployment, tokenizer):
    client = deployment.client
    lines = [_line("a", "The capital of France is"), _line("b", "word " * 9000), _line("c", "Count to three.")]
    file_id = _upload(client, _jsonl(lines)).json()["id"]
    answer = client.post(
        "/v1/batches",
        headers=_bearer(USER_KEY),
        params={"dry_run": "true"},
        json={"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"},
    )
    assert answer.status_code == 200, answer.text
    estimate = answer.json()
    assert estimate["dry_run"] is True and estimate["num_requests"] == 3
    # Counted as the worker renders them (the chat template), the one past the context left out.
    rendered = [
        tokenizer.apply_chat_template(line["body"]["messages"], tokenize=False, add_generation_prompt=True)
        for line in (lines[0], lines[2])
    ]
    assert estimate["prompt_tokens"] == sum(len(tokenizer.encode(text, add_special_tokens=False)) for text in rendered)
    assert estimate["max_output_tokens"] == 4 + 4
    assert [(problem["index"], problem["code"]) for problem in estimate["cannot_run"]] == [(1, "prompt_too_long")]
    assert estimate["no_history"].startswith("no history")
    # Nothing was made: no batch, no job, no work dir left behind.
    assert client.get("/v1/batches", headers=_bearer(USER_KEY)).json()["data"] == []
    assert deployment.store.list().jobs == []
    assert sorted(path.name for path in (deployment.home / "work").iterdir()) == ["files"]

    bad = _upload(client, _jsonl([_line("a"), "{not json"])).json()["id"]
    refused = client.post(
        "/v1/batches",
        headers=_bearer(USER_KEY),
        params={"dry_run": "true"},
        json={"input_file_id": bad, "endpoint": CHAT, "completion_window": "24h"},
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input_file_id"
    assert "line 2" in refused.json()["error"]["message"]
    assert sorted(path.name for path in (deployment.home / "work").iterdir()) == ["files"]


def test_a_batch_finalized_again_replaces_its_files_and_leaves_no_old_one(tmp_path):
    from datetime import datetime

    from batch_pipeline.openai_batch.jobs import keep_results, write_result_files
    from batch_pipeline.store.openai import BatchRecord, OpenAIStore

    store = OpenAIStore(f"sqlite:///{tmp_path}/jobs.db")
    store.add_batch(
        BatchRecord(
            batch_id="batch-1",
            owner="o",
            endpoint=CHAT,
            input_file_id="file-1",
            completion_window="24h",
            created_at=datetime.now(UTC),
            total=1,
        )
    )
    custom_ids = tmp_path / "custom_ids.jsonl"
    custom_ids.write_text('"a"\n')
    files = tmp_path / "files"
    cancelled = {"error": {"code": "cancelled", "message": "the batch was cancelled"}}
    keep_results(store, "batch-1", write_result_files("batch-1", "o", str(custom_ids), [cancelled], str(files)))
    first = store.get_batch("batch-1")
    answered = {"id": "chatcmpl-1", "object": "chat.completion", "choices": []}
    keep_results(store, "batch-1", write_result_files("batch-1", "o", str(custom_ids), [answered], str(files)))
    second = store.get_batch("batch-1")  # a re-execution finished what the cancel left
    assert (second.completed, second.failed, second.error_file_id) == (1, 0, None)
    assert store.get_file(first.error_file_id) is None and store.get_file(second.output_file_id) is not None
    assert sorted(path.name for path in files.iterdir()) == [second.output_file_id]


def test_an_operator_catalog_maps_a_batchs_model_name_to_a_whole_model_config(
    deployment_factory, tmp_path, monkeypatch
):
    catalog = tmp_path / "models.yaml"
    catalog.write_text(
        f"small-chat:\n  model: {MODEL}\n  max_model_len: 1024\n  served_model_name: small-chat\n"
        "broken:\n  max_model_len: -1\n"
    )
    monkeypatch.setenv("BATCH_PIPELINE_MODEL_CATALOG", str(catalog))  # read as the deployment starts
    deployment = deployment_factory()
    client = deployment.client
    batch = _create(client, _upload(client, _jsonl([_line("a", model="small-chat")])).json()["id"]).json()
    assert batch["status"] == "in_progress", batch
    model_config = deployment.job(batch["id"])["model_config"]
    assert (model_config["model"], model_config["max_model_len"]) == (MODEL, 1024)
    # A catalog entry that does not validate fails the batch naming the model, not the server.
    broken = _create(client, _upload(client, _jsonl([_line("a", model="broken")])).json()["id"]).json()
    assert broken["status"] == "failed"
    assert [(e["code"], e["param"]) for e in broken["errors"]["data"]] == [("invalid_model", "body.model")]


def test_an_operator_catalog_name_for_a_model_that_cannot_serve_the_endpoint_fails_its_batch(
    deployment_factory, tmp_path, monkeypatch
):
    """The check of the model against the endpoint follows the operator's name to the model it maps to."""
    catalog = tmp_path / "models.yaml"
    catalog.write_text(f"embedder:\n  model: {EMBEDDING_MODEL}\nchatter:\n  model: {MODEL}\n")
    monkeypatch.setenv("BATCH_PIPELINE_MODEL_CATALOG", str(catalog))
    client = deployment_factory().client
    for endpoint, line in [
        (CHAT, _line("chat", model="embedder")),
        (EMBEDDINGS, _embedding_line("embed", model="chatter", input="x")),
    ]:
        batch = _create(client, _upload(client, _jsonl([line])).json()["id"], endpoint=endpoint).json()
        assert batch["status"] == "failed", batch
        [error] = batch["errors"]["data"]
        assert (error["code"], error["param"]) == ("model_not_served", "body.model"), error
        assert endpoint in error["message"]
