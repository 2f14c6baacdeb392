"""The official `openai` SDK, unchanged, drives a batch through `make serve` (the API, the Dagster daemon
and webserver, vLLM in the shard worker): upload, create, poll, download."""

import base64
import json
import time

import httpx
import numpy as np
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


EMBEDDING_MODEL = "all-minilm-l6-v2"


@pytest.mark.slow
def test_the_openai_sdk_runs_an_embeddings_batch_whose_every_output_line_parses_as_its_embedding_response(served):
    import openai
    from openai.types import CreateEmbeddingResponse
    from transformers import AutoTokenizer

    from batch_pipeline.models.catalog import resolve_model

    served.wait_until_up()
    client = openai.OpenAI(base_url=f"{served.api}/v1", api_key=KEY, max_retries=0)
    texts = ["The capital of France is Paris.", "A cat sat on the mat.", "Batch inference, one engine."]
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(EMBEDDING_MODEL))
    bodies = {
        "one": {"input": texts[0]},
        "several": {"input": texts, "encoding_format": "float"},
        "ids": {"input": tokenizer(texts[1])["input_ids"]},
        "base64": {"input": texts[2], "encoding_format": "base64"},
        "again": {"input": texts[0]},  # line 1 again: computed once, answered twice
        "past-vocabulary": {"input": [101, 10**6, 102]},
        "dimensions": {"input": "x", "dimensions": 10**9},
    }
    lines = [
        {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": {"model": EMBEDDING_MODEL, **body}}
        for custom_id, body in bodies.items()
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("embeddings.jsonl", data), purpose="batch")

    # The dry run counts the lines' input tokens as the worker tokenizes them, and plans no output.
    estimate = httpx.post(
        f"{served.api}/v1/batches",
        params={"dry_run": "true"},
        headers={"Authorization": f"Bearer {KEY}"},
        json={"input_file_id": uploaded.id, "endpoint": "/v1/embeddings", "completion_window": "24h"},
        timeout=300,
    ).json()
    counted = [tokenizer(text)["input_ids"] for text in (texts[0], *texts, texts[2], texts[0])]
    assert estimate["prompt_tokens"] == sum(map(len, counted)) + len(bodies["ids"]["input"]), estimate
    assert estimate["max_output_tokens"] == 0, estimate

    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    deadline = time.monotonic() + 600
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"batch still {batch.status}\n{served.log.read_text()[-3000:]}"
        time.sleep(1)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", (batch, served.log.read_text()[-3000:])
    assert batch.request_counts.model_dump() == {"total": 7, "completed": 5, "failed": 2}

    outputs = {
        line["custom_id"]: line
        for line in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())
    }
    assert list(outputs) == ["one", "several", "ids", "base64", "again"]
    prompt_tokens = 0
    for custom_id, line in outputs.items():
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        if custom_id == "base64":  # the SDK decodes base64 vectors before its type reads them
            vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
            body = {**body, "data": [{**body["data"][0], "embedding": vector.tolist()}]}
        parsed = CreateEmbeddingResponse.model_validate(body)
        assert parsed.model == EMBEDDING_MODEL and all(len(entry.embedding) == 384 for entry in parsed.data)
        prompt_tokens += parsed.usage.prompt_tokens
    assert len(outputs["several"]["response"]["body"]["data"]) == 3
    assert outputs["again"]["response"]["body"]["data"] == outputs["one"]["response"]["body"]["data"]

    failed = {
        line["custom_id"]: line["response"]["body"]["error"]
        for line in map(json.loads, client.files.content(batch.error_file_id).text.splitlines())
    }
    assert {custom_id: error["param"] for custom_id, error in failed.items()} == {
        "past-vocabulary": "input",
        "dimensions": "dimensions",
    }
    # The batch's usage, and the usage report, count the input tokens; an embedding generates none.
    assert (batch.usage.input_tokens, batch.usage.output_tokens) == (prompt_tokens, 0)
    usage = httpx.get(f"{served.api}/v2/usage", headers={"x-api-key": KEY}, timeout=30).json()
    assert sum(day["prompt_tokens"] for day in usage["days"]) == prompt_tokens, usage


@pytest.mark.slow
def test_the_openai_sdk_runs_a_responses_batch_whose_every_output_line_parses_as_its_response(served):
    import openai
    from openai.types.responses import Response

    served.wait_until_up()
    client = openai.OpenAI(base_url=f"{served.api}/v1", api_key=KEY, max_retries=0)
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    bodies = {
        "plain": {"input": "Say hello.", "max_output_tokens": 4, "temperature": 0},
        "items": {
            "instructions": "Answer in one word.",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "What colour is the sky?"}]}],
            "max_output_tokens": 4,
            "metadata": {"team": "a"},
        },
        "json": {
            "input": "What is 2+2? Reply in JSON.",
            "max_output_tokens": 24,
            "temperature": 0,
            "text": {"format": {"type": "json_schema", "name": "sum", "schema": schema, "strict": True}},
        },
        "tools": {"input": "Search the web.", "tools": [{"type": "web_search"}]},
        "previous": {"input": "And then?", "previous_response_id": "resp_123"},
        "image": {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
    }
    lines = [
        {"custom_id": custom_id, "method": "POST", "url": "/v1/responses", "body": {"model": MODEL, **body}}
        for custom_id, body in bodies.items()
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("responses.jsonl", data), purpose="batch")
    estimate = httpx.post(
        f"{served.api}/v1/batches",
        params={"dry_run": "true"},
        headers={"Authorization": f"Bearer {KEY}"},
        json={"input_file_id": uploaded.id, "endpoint": "/v1/responses", "completion_window": "24h"},
        timeout=300,
    ).json()

    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/responses", completion_window="24h")
    deadline = time.monotonic() + 600
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"batch still {batch.status}\n{served.log.read_text()[-3000:]}"
        time.sleep(1)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", (batch, served.log.read_text()[-3000:])
    assert batch.request_counts.model_dump() == {"total": 6, "completed": 3, "failed": 3}

    outputs = {
        line["custom_id"]: line
        for line in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())
    }
    assert list(outputs) == ["plain", "items", "json"]
    parsed = {}
    for custom_id, line in outputs.items():
        assert line["error"] is None and line["response"]["status_code"] == 200
        parsed[custom_id] = Response.model_validate(line["response"]["body"])
        assert parsed[custom_id].model == MODEL and parsed[custom_id].output[0].type == "message"
    assert parsed["plain"].status == "incomplete" and parsed["plain"].usage.output_tokens == 4
    assert parsed["items"].metadata == {"team": "a"} and parsed["items"].instructions == "Answer in one word."
    answer = json.loads(parsed["json"].output_text)
    assert set(answer) == {"answer"} and isinstance(answer["answer"], int), parsed["json"].output_text

    failed = {
        line["custom_id"]: line["response"]["body"]["error"]
        for line in map(json.loads, client.files.content(batch.error_file_id).text.splitlines())
    }
    assert {custom_id: (error["code"], error["param"]) for custom_id, error in failed.items()} == {
        "tools": ("unsupported_field", "tools"),
        "previous": ("unsupported_field", "previous_response_id"),
        "image": ("unsupported_field", "input.0.content.0"),
    }
    # The dry run, the batch's usage and the usage report count a response's input and output tokens.
    input_tokens = sum(response.usage.input_tokens for response in parsed.values())
    output_tokens = sum(response.usage.output_tokens for response in parsed.values())
    assert estimate["prompt_tokens"] == input_tokens, estimate
    assert (batch.usage.input_tokens, batch.usage.output_tokens) == (input_tokens, output_tokens)
    usage = httpx.get(f"{served.api}/v2/usage", headers={"x-api-key": KEY}, timeout=30).json()
    assert sum(day["prompt_tokens"] for day in usage["days"]) == input_tokens, usage
    assert sum(day["completion_tokens"] for day in usage["days"]) == output_tokens, usage
