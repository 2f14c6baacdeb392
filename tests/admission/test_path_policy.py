"""The one path policy, tried as an attacker would: every path a request names (input, output, the output's
metadata file, checkpoint, model, tokenizer) through the real API and the real job; fsspec's chained and
aliased URLs, unknown protocols, NUL bytes and lone surrogates; object keys that climb out of the model
cache; and trust_remote_code, which only the operator can allow."""

import json
import re

import pytest

from tests.api_fixtures import USER_KEY
from tests.conftest import MODEL, step_failure_messages
from tests.core.test_s3 import s3  # noqa: F401  (the local S3 server fixture)

ALICE = {"x-api-key": USER_KEY}
CONTENT = {"prompts": ["x"], "max_new_tokens": 1, "temperature": 0.0}


def _post(api, body: dict):
    # Serialized here, not by httpx: its encoder cannot write a lone surrogate, JSON's \ud800 escape can.
    return api.client.post(
        "/v2/batch-completions",
        content=json.dumps(body).encode(),
        headers={**ALICE, "content-type": "application/json"},
    )


def _refused_fields(response) -> list[str]:
    assert response.status_code == 422, response.text
    return [".".join(map(str, problem["loc"][1:])) for problem in response.json()["detail"]]


@pytest.fixture
def data_root(tmp_path, monkeypatch):
    root = tmp_path / "data"
    (root / "models" / "m").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    monkeypatch.setenv("BATCH_PIPELINE_DATA_ROOTS", str(root))
    return root, outside


def test_chained_aliased_and_unknown_fsspec_urls_cannot_leave_the_data_roots(deployment_factory, data_root):
    root, outside = data_root
    victim = outside / "victim.json"
    victim.write_text("[]")
    api = deployment_factory()
    hostile = [
        f"simplecache::file://{victim}",
        f"filecache::file://{victim}",
        "blockcache::file:///etc/passwd",
        f"dir::{outside}",
        f"simplecache::{root}/inside-but-chained.json",
        f"file:{victim}",
        f"local://{victim}",
        f"file://{outside.relative_to('/')}/victim.json",
        f"file:{root}/../outside/victim.json",
        "foo://x.json",
        "memory://x.json",
        "FILE:///etc/passwd",
        "data:application/json,[]",
    ]
    for field in ("input_data_path", "output_data_path"):
        for path in hostile:
            body = {"output_data_path": f"{root}/out.json", "model_config": {"model": MODEL}, field: path}
            if field == "output_data_path":
                body["content"] = CONTENT
            assert _refused_fields(_post(api, body)) == [field], (field, path)
    assert api.store.list().jobs == []
    assert victim.read_text() == "[]"
    # The local spellings fsspec reads as the same file are honoured when they stay inside.
    for output in (f"file://{root}/a.json", f"local://{root}/b.json", f"file:{root}/c.json", f"{root}/d.json"):
        body = {"output_data_path": output, "model_config": {"model": MODEL}, "content": CONTENT}
        assert _post(api, body).status_code == 200, output


def test_without_data_roots_any_local_path_goes_but_unknown_protocols_and_chains_do_not(
    deployment_factory, tmp_path, monkeypatch
):
    monkeypatch.delenv("BATCH_PIPELINE_DATA_ROOTS", raising=False)
    api = deployment_factory()
    # An invalid bucket would make every later status read of the job fail in botocore.
    for output in (
        "foo://x.json",
        f"simplecache::file://{tmp_path}/o.json",
        "memory://o.json",
        "s3://",
        "s3://bucket",
        f"s3://{'b' * 300}/o.json",
        "s3://a bucket/o.json",
    ):
        body = {"output_data_path": output, "model_config": {"model": MODEL}, "content": CONTENT}
        assert _refused_fields(_post(api, body)) == ["output_data_path"], output
    for output in (f"{tmp_path}/o.json", "relative/o.json", "s3://bucket/o.json"):
        body = {"output_data_path": output, "model_config": {"model": MODEL}, "content": CONTENT}
        assert _post(api, body).status_code == 200, output
    listed = api.client.get("/v2/batch-completions", headers=ALICE)
    assert listed.status_code == 200 and len(listed.json()["jobs"]) == 3


def test_an_operator_chooses_the_protocols(deployment_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCH_PIPELINE_ALLOWED_PROTOCOLS", "s3")  # a deployment with object stores only
    api = deployment_factory()
    for output, status in ((f"{tmp_path}/o.json", 422), (f"file://{tmp_path}/o.json", 422), ("s3://b/o.json", 200)):
        body = {"output_data_path": output, "model_config": {"model": MODEL}, "content": CONTENT}
        assert _post(api, body).status_code == status, output


@pytest.mark.parametrize("bad", ["a\x00b", "a\ud800b"], ids=["nul", "lone-surrogate"])
def test_a_nul_byte_or_lone_surrogate_in_any_path_is_a_422_naming_the_field(deployment_factory, data_root, bad):
    root, _ = data_root
    api = deployment_factory()
    base = {"output_data_path": f"{root}/o.json", "model_config": {"model": MODEL}, "content": CONTENT}
    cases = {
        "output_data_path": {**base, "output_data_path": f"{root}/{bad}.json"},
        "input_data_path": {**base, "content": None, "input_data_path": f"{root}/{bad}.json"},
        "model_config.checkpoint_path": {**base, "model_config": {"model": MODEL, "checkpoint_path": f"{root}/{bad}"}},
        "model_config.model": {**base, "model_config": {"model": f"{root}/{bad}"}},
        "model_config.tokenizer": {**base, "model_config": {"model": MODEL, "tokenizer": f"{root}/{bad}"}},
    }
    for field, body in cases.items():
        assert _refused_fields(_post(api, body)) == [field], field
    assert api.store.list().jobs == []


def test_model_tokenizer_and_checkpoint_paths_are_held_to_the_data_roots(deployment_factory, data_root):
    root, outside = data_root
    (root / "models" / "escape").symlink_to(outside)
    api = deployment_factory()
    base = {"output_data_path": f"{root}/o.json", "content": CONTENT}
    refused = {
        "model_config.model": [
            {"model": "/etc"},
            {"model": f"{root}/../outside"},
            {"model": f"{root}/models/escape"},
            {"model": "./models/m"},
            {"model": "~/m"},
            {"model": "foo://m"},
            {"model": "simplecache::s3://b/m"},
        ],
        "model_config.tokenizer": [{"model": MODEL, "tokenizer": str(outside)}, {"model": MODEL, "tokenizer": "../t"}],
        "model_config.checkpoint_path": [
            {"model": MODEL, "checkpoint_path": str(outside)},
            {"model": MODEL, "checkpoint_path": "blockcache::s3://b/m"},
            {"model": MODEL, "checkpoint_path": "foo://b/m"},
        ],
    }
    for field, configs in refused.items():
        for model_config in configs:
            assert _refused_fields(_post(api, {**base, "model_config": model_config})) == [field], model_config
    # A hub id passes the data roots; the submission then reads it as its dry run would: 200 where this
    # machine reaches the hub, else the reading's 422, never a path's.
    hub = _post(api, {**base, "model_config": {"model": "HuggingFaceTB/SmolLM2-135M-Instruct"}})
    assert hub.status_code == 200 or "the model cannot be read here" in hub.json()["detail"][0]["msg"], hub.text
    accepted = [
        {"model": MODEL},
        {"model": MODEL.upper()},
        {"model": f"{root}/models/m"},
        {"model": MODEL, "tokenizer": f"{root}/models/m"},
        {"model": "mine", "checkpoint_path": "s3://b/weights"},
        {"model": "mine", "checkpoint_path": f"{root}/models/m"},
    ]
    for model_config in accepted:
        assert _post(api, {**base, "model_config": model_config}).status_code == 200, model_config


def test_the_output_metadata_file_is_held_to_the_data_roots_too(deployment_factory, data_root):
    root, outside = data_root
    (root / "o.json.metadata.json").symlink_to(outside / "stolen.json")
    api = deployment_factory()
    body = {"output_data_path": f"{root}/o.json", "model_config": {"model": MODEL}, "content": CONTENT}
    response = _post(api, body)
    assert _refused_fields(response) == ["output_data_path"]
    assert "metadata" in response.json()["detail"][0]["msg"]


def test_trust_remote_code_is_refused_unless_the_operator_allows_it(deployment_factory, tmp_path, monkeypatch):
    monkeypatch.delenv("BATCH_PIPELINE_ALLOW_REMOTE_CODE", raising=False)
    api = deployment_factory()
    body = {
        "output_data_path": f"{tmp_path}/o.json",
        "content": CONTENT,
        "model_config": {"model": MODEL, "trust_remote_code": True},
    }
    assert _refused_fields(_post(api, body)) == ["model_config.trust_remote_code"]
    assert _post(api, {**body, "model_config": {"model": MODEL, "trust_remote_code": False}}).status_code == 200
    monkeypatch.setenv("BATCH_PIPELINE_ALLOW_REMOTE_CODE", "1")
    assert _post(api, body).status_code == 422  # read when the deployment started, not at each request
    assert _post(deployment_factory(), body).status_code == 200


def test_a_shard_worker_gets_trust_remote_code_only_from_the_operators_policy(monkeypatch):
    from batch_pipeline.admission.paths import PathPolicy
    from batch_pipeline.admission.policy import AdmissionPolicy
    from batch_pipeline.contract.model_config import BatchCompletionsModelConfig

    asked = BatchCompletionsModelConfig(model=MODEL, trust_remote_code=True)
    unbounded = {"paths": PathPolicy(frozenset({"file"}), ()), "tenants_file": "", "hardware_maxima": {}}
    refusing = AdmissionPolicy(**unbounded, allow_remote_code=False, engine_maxima={})
    assert refusing.shard_model_config(asked).trust_remote_code is False
    allowing = AdmissionPolicy(**unbounded, allow_remote_code=True, engine_maxima={})
    assert allowing.shard_model_config(asked).trust_remote_code is True
    assert allowing.shard_model_config(BatchCompletionsModelConfig(model=MODEL)).trust_remote_code is False


def test_a_launchpad_run_is_held_to_the_same_policy(run_job, data_root, monkeypatch):
    root, outside = data_root
    monkeypatch.delenv("BATCH_PIPELINE_ALLOW_REMOTE_CODE", raising=False)
    victim = outside / "victim.json"
    result = run_job(
        {"output_data_path": f"simplecache::file://{victim}", "model_config": {"model": MODEL}, "content": CONTENT}
    )
    assert not result.success
    (message,) = step_failure_messages(result)
    assert "output_data_path: chained URLs" in message
    assert not victim.exists()
    result = run_job(
        {
            "output_data_path": f"{root}/o.json",
            "content": CONTENT,
            "model_config": {"model": MODEL, "trust_remote_code": True},
        }
    )
    assert not result.success
    (message,) = step_failure_messages(result)
    assert "model_config.trust_remote_code: this server does not run a model's own code" in message


def test_a_launchpad_run_cannot_name_a_content_file_only_the_submission_path_may(dagster_home, tmp_path):
    """`content_path` is how a stored job names the content it was sent; a run from the launchpad that
    names one (another job's prompts, say) fails before reading it."""
    from batch_pipeline.admission.submission import StoredRequest
    from batch_pipeline.pipeline.execute import execute_request

    others = tmp_path / "work" / "batch-someone-else" / "content.json"
    others.parent.mkdir(parents=True)
    others.write_text(json.dumps({"prompts": ["someone else's secret"], "max_new_tokens": 1, "temperature": 0.0}))
    output = tmp_path / "o.json"
    request = StoredRequest.model_validate(
        {"output_data_path": str(output), "model_config": {"model": MODEL}, "content_path": str(others)}
    )
    result = execute_request(request, dagster_home)
    assert not result.success
    (message,) = step_failure_messages(result)
    assert "content_path: set by the submission path only" in message
    assert not output.exists()


def test_the_metadata_path_the_policy_checks_is_the_one_the_job_writes():
    from batch_pipeline.admission.paths import metadata_path
    from batch_pipeline.pipeline.job import metadata_path as written_by_the_job

    assert metadata_path("s3://b/o.json") == written_by_the_job("s3://b/o.json")


def test_paths_with_glob_characters_are_plain_files_to_the_job(tmp_path):
    from batch_pipeline.core import io

    path = str(tmp_path / "results[1]*.json")
    assert io.exists(path) is False  # was: fsspec expanded the glob and a status read failed
    with io.atomic_write(path) as handle:
        handle.write("[]")
    assert io.exists(path) and io.exists(path + ".metadata.json") is False


def test_object_keys_that_climb_out_of_a_synced_checkpoint_are_refused(s3, tmp_path, monkeypatch):  # noqa: F811
    from batch_pipeline.models.sync import sync_remote_checkpoint

    cache = tmp_path / "cache"
    monkeypatch.setenv("BATCH_PIPELINE_MODEL_CACHE", str(cache))
    s3.put_object(Bucket="batch", Key="weights/m/config.json", Body=b"{}")
    # From the checkpoint's directory in the cache, three levels up is tmp_path.
    for key in (
        "weights/m/../../../escape.json",
        "weights/m/sub/../../../../up.json",
        "weights/m//abs.json",
        "weights/m/./dot.json",
    ):
        s3.put_object(Bucket="batch", Key=key, Body=b"{}")
        with pytest.raises(ValueError, match=f"model_config.checkpoint_path: .*{re.escape(key)}"):
            sync_remote_checkpoint("s3://batch/weights/m")
        s3.delete_object(Bucket="batch", Key=key)
    written = sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*.json"))
    assert written == []  # nothing synced at all, inside the cache or out of it
    local = sync_remote_checkpoint("s3://batch/weights/m")
    assert sorted(p.name for p in local.iterdir() if not p.name.startswith(".")) == ["config.json"]
