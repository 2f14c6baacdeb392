"""The official `openai` SDK, unchanged, drives a batch through `make serve` (the API, the Dagster daemon
and webserver, vLLM in the shard worker): upload, create, poll, download."""

import json
import time

import httpx
import pytest

from tests.conftest import MODEL
from tests.entrypoints.test_serve import Served

KEY = "sdk-key"


@pytest.fixture
def served(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCH_PIPELINE_API_KEYS", KEY)
    server = Served(tmp_path)
    yield server
    server.kill()


@pytest.mark.slow
def test_the_openai_sdk_uploads_runs_polls_and_downloads_a_batch(served):
    import openai

    served.wait_until_up()
    client = openai.OpenAI(base_url=f"{served.api}/v1", api_key=KEY, max_retries=0)
    prompts = {"capital": "What is the capital of France?", "colour": "Name a colour.", "count": "Count to three."}
    lines = [
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": 8,
                "temperature": 0,
            },
        }
        for custom_id, text in prompts.items()
    ]
    # Longer than the model's 8k context: that request fails alone, in the error file.
    lines.insert(
        1,
        {
            "custom_id": "too-long",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": "word " * 9000}], "max_tokens": 8},
        },
    )
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()

    uploaded = client.files.create(file=("requests.jsonl", data), purpose="batch")
    assert uploaded.bytes == len(data) and uploaded.purpose == "batch"
    assert client.files.content(uploaded.id).content == data
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"team": "sdk"}
    )
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"team": "sdk"}

    deadline = time.monotonic() + 600
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"batch still {batch.status}\n{served.log.read_text()[-3000:]}"
        time.sleep(1)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", (batch, served.log.read_text()[-3000:])
    assert batch.request_counts.model_dump() == {"total": 4, "completed": 3, "failed": 1}
    assert batch.completed_at >= batch.in_progress_at >= batch.created_at
    assert batch.model == MODEL  # the SDK's Batch.model: the model of the file's lines

    outputs = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert [line["custom_id"] for line in outputs] == list(prompts)
    for line in outputs:
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"].strip()
        assert 1 <= body["usage"]["completion_tokens"] <= 8
        assert "tool_calls" not in body["choices"][0]["message"]  # as OpenAI's, where the model calls none
    # Response ids are unique, not the line's index alone (chatcmpl-0 in every batch).
    ids = [line["response"]["body"]["id"] for line in outputs]
    assert len(set(ids)) == len(ids) and all(len(id_) > len("chatcmpl-0") + 8 for id_ in ids), ids

    [failed] = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert failed["custom_id"] == "too-long" and failed["error"]["code"] == "prompt_too_long"
    assert failed["response"]["status_code"] == 400
    assert failed["response"]["body"]["error"]["code"] == "prompt_too_long"

    assert batch.id in [listed.id for listed in client.batches.list(limit=10)]
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    # The same job on the batch completions API.
    job = httpx.get(f"{served.api}/v2/batch-completions/{batch.id}", headers={"x-api-key": KEY}, timeout=30).json()
    assert job["job"]["status"] == "completed" and job["job"]["metadata"]["num_errors"] == "1"

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served.api}/v1", api_key="wrong", max_retries=0).batches.list()
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch-does-not-exist")
