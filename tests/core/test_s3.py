"""s3:// input, output and model weights against a real S3 API: a local moto server over HTTP (s3fs through
fsspec), with the real job and real vLLM."""

import json
import socket
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import MODEL, step_failure_messages


@pytest.fixture
def s3(monkeypatch):
    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    # What a deployment sets for a MinIO-style store; the steps and workers inherit it.
    for key, value in {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    # Every in-process moto server shares one backend: reset it, so no test sees an earlier test's objects.
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")).close()
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="batch")
    yield client
    server.stop()
    # fsspec reuses an S3FileSystem (and its connection to this server's port) for the same arguments: the
    # next test's server is on another port.
    from s3fs import S3FileSystem

    S3FileSystem.clear_instance_cache()


@pytest.mark.slow
def test_a_job_reads_its_input_from_s3_and_writes_its_output_there(run_job, s3):
    content = [
        {"prompts": ["The capital of France is", "Water boils at"], "max_new_tokens": 6, "temperature": 0.0},
        {"prompts": ["1, 2, 3,"], "max_new_tokens": 4, "temperature": 0.0},
    ]
    s3.put_object(Bucket="batch", Key="in/requests.jsonl", Body="".join(json.dumps(c) + "\n" for c in content))
    result = run_job(
        {
            "input_data_path": "s3://batch/in/requests.jsonl",
            "output_data_path": "s3://batch/out/o.json",
            "model_config": {"model": MODEL},
            "data_parallelism": 2,
        }
    )
    assert result.success, step_failure_messages(result)
    outputs = json.loads(s3.get_object(Bucket="batch", Key="out/o.json")["Body"].read())
    assert len(outputs) == 3 and all(output["text"] for output in outputs)
    metadata = json.loads(s3.get_object(Bucket="batch", Key="out/o.json.metadata.json")["Body"].read())
    assert metadata["num_requests"] == 3 and metadata["output_data_path"] == "s3://batch/out/o.json"
    keys = [item["Key"] for item in s3.list_objects_v2(Bucket="batch", Prefix="out/")["Contents"]]
    assert sorted(keys) == ["out/o.json", "out/o.json.metadata.json"]  # no probe or partial objects left


@pytest.mark.slow
def test_an_output_bucket_that_does_not_exist_fails_before_any_inference(run_job, s3):
    result = run_job(
        {
            "output_data_path": "s3://no-such-bucket/o.json",
            "model_config": {"model": MODEL},
            "content": {"prompts": ["x"], "max_new_tokens": 2, "temperature": 0.0},
        }
    )
    assert not result.success
    (message,) = step_failure_messages(result)
    assert "output_data_path: cannot write s3://no-such-bucket/o.json" in message
    started = {event.step_key for event in result.all_events if event.event_type_value == "STEP_START"}
    assert started == {"validate_input"}


def test_a_remote_checkpoint_is_synced_once_with_only_weights_configs_and_tokenizer_files(s3, tmp_path, monkeypatch):
    from batch_pipeline.models.sync import sync_remote_checkpoint

    monkeypatch.setenv("BATCH_PIPELINE_MODEL_CACHE", str(tmp_path / "cache"))
    files = {
        "config.json": b"{}",
        "model-00001.safetensors": b"w" * 1000,
        "tokenizer.json": b"{}",
        "sub/generation_config.json": b"{}",
        "modeling_custom.py": b"import os",
        "pytorch_model.bin": b"pickle",
    }
    for name, data in files.items():
        s3.put_object(Bucket="batch", Key=f"weights/m/{name}", Body=data)

    local = sync_remote_checkpoint("s3://batch/weights/m")
    found = sorted(str(path.relative_to(local)) for path in local.rglob("*") if path.is_file())
    assert found == ["config.json", "model-00001.safetensors", "sub/generation_config.json", "tokenizer.json"]
    assert (local / "model-00001.safetensors").read_bytes() == b"w" * 1000

    before = (local / "model-00001.safetensors").stat().st_mtime_ns
    assert sync_remote_checkpoint("s3://batch/weights/m") == local
    assert (local / "model-00001.safetensors").stat().st_mtime_ns == before  # reused, not downloaded again
    s3.put_object(Bucket="batch", Key="weights/m/model-00001.safetensors", Body=b"v" * 1200)
    sync_remote_checkpoint("s3://batch/weights/m", trust_remote_code=True)
    assert (local / "model-00001.safetensors").read_bytes() == b"v" * 1200  # a changed file is fetched
    assert (local / "modeling_custom.py").exists()  # code only when the request trusts it
    with pytest.raises(FileNotFoundError, match="model_config.checkpoint_path: nothing at s3://batch/none"):
        sync_remote_checkpoint("s3://batch/none")


@pytest.mark.slow
def test_a_job_loads_its_weights_from_an_s3_checkpoint_path(run_job, s3, tmp_path, monkeypatch):
    from batch_pipeline.models.catalog import resolve_model

    prepared = Path(resolve_model(MODEL))
    for path in prepared.rglob("*"):
        if path.is_file():
            s3.upload_file(str(path), "batch", f"weights/smollm2/{path.relative_to(prepared)}")
    monkeypatch.setenv("BATCH_PIPELINE_MODEL_CACHE", str(tmp_path / "cache"))
    output = tmp_path / "out.json"
    result = run_job(
        {
            "output_data_path": str(output),
            "model_config": {"model": "my-smollm2", "checkpoint_path": "s3://batch/weights/smollm2"},
            "content": {"prompts": ["The capital of France is"], "max_new_tokens": 4, "temperature": 0.0},
        }
    )
    assert result.success, step_failure_messages(result)
    assert json.loads(output.read_text())[0]["text"]
    assert list((tmp_path / "cache" / "remote").glob("*/model.safetensors"))


@pytest.mark.slow
def test_shard_work_dirs_on_s3_are_shared_and_a_stored_checkpoint_is_resumed(run_job, s3, tmp_path, monkeypatch):
    from batch_pipeline.shards.format import format_result

    monkeypatch.setenv("BATCH_PIPELINE_WORK_DIR", "s3://batch/work")  # what pods on different nodes share
    shard = "work/s3-work/shards/000"
    # a previous attempt's checkpoint, as an earlier pod uploaded it
    seeded = {"text": " SEEDED", "num_prompt_tokens": 5, "num_completion_tokens": 1}
    s3.put_object(Bucket="batch", Key=f"{shard}/results.tsv", Body=format_result(0, seeded))
    output = tmp_path / "out.json"
    result = run_job(
        {
            "output_data_path": str(output),
            "model_config": {"model": MODEL},
            "content": {
                "prompts": ["The capital of France is", "Water boils at"],
                "max_new_tokens": 4,
                "temperature": 0.0,
            },
        },
        job_id="s3-work",
    )
    assert result.success, step_failure_messages(result)
    first, second = json.loads(output.read_text())
    assert first == seeded and second["text"] != seeded["text"]  # the stored result was kept, not redone
    keys = {item["Key"] for item in s3.list_objects_v2(Bucket="batch", Prefix=shard)["Contents"]}
    assert {f"{shard}/input.jsonl", f"{shard}/results.tsv", f"{shard}/output.tsv"} <= keys
    stored = s3.get_object(Bucket="batch", Key=f"{shard}/results.tsv")["Body"].read().decode().splitlines()
    assert sorted(int(line.split("\t")[0]) for line in stored) == [0, 1]
    stats = json.loads((tmp_path / "out.json.metadata.json").read_text())["shards"][0]
    assert stats["resumed"] == 1 and stats["generated"] == 1


def test_a_checkpoint_on_s3_is_uploaded_at_the_interval_its_worker_was_given(s3):
    """A pod killed mid-shard loses at most BATCH_PIPELINE_CHECKPOINT_UPLOAD_S of work: the results appended
    reach the store once that long has passed since the last upload, and not before."""
    from batch_pipeline.shards.format import format_result
    from batch_pipeline.worker.checkpoint import Checkpoint

    def stored(key: str) -> list[str]:
        listed = s3.list_objects_v2(Bucket="batch", Prefix=key).get("Contents", [])
        if not listed:
            return []
        return s3.get_object(Bucket="batch", Key=key)["Body"].read().decode().splitlines()

    for upload_every_s, key in ((3600.0, "work/hourly/results.tsv"), (0.0, "work/always/results.tsv")):
        checkpoint = Checkpoint(f"s3://batch/{key}", upload_every_s)
        with checkpoint.appending() as results:
            results.write(format_result(0, {"text": " done"}))
        checkpoint.upload_if_due()
        assert len(stored(key)) == (1 if upload_every_s == 0 else 0), upload_every_s
        checkpoint.upload()  # as the worker does when it stops
        assert [line.split("\t")[0] for line in stored(key)] == ["0"]
        checkpoint.discard_local_copy()
