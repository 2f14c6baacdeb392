"""The deployment's admission policy is built once, where the deployment is composed, and handed to what
checks requests: the API's service and the job's ops (their `admission` resource). What they admit is the
policy they were given, not what the environment says when a request arrives."""

import dataclasses
import hashlib
from pathlib import Path

import dagster as dg
from fastapi.testclient import TestClient

from batch_pipeline.admission.hardware import hardware_maxima
from batch_pipeline.admission.paths import PathPolicy
from batch_pipeline.admission.policy import AdmissionPolicy
from batch_pipeline.api.app import create_app
from batch_pipeline.api.auth import ApiKeys
from batch_pipeline.api.service import BatchJobService
from batch_pipeline.contract import CreateBatchCompletionsV2Request
from batch_pipeline.core.settings import settings
from batch_pipeline.dry_run.estimate import DryRuns
from batch_pipeline.launch.local import LocalShardLauncher
from batch_pipeline.pipeline.config_schema import run_config_for
from batch_pipeline.pipeline.job import batch_completions
from batch_pipeline.pipeline.resources import JobStorage, JobStoreResource, ShardPlanning
from batch_pipeline.store.jobs import JobStore
from tests.conftest import MODEL, step_failure_messages

KEY = "key-alice"


def _body(output: str, **fields) -> dict:
    content = {"prompts": ["x"], "max_new_tokens": 1, "temperature": 0.0}
    return {"output_data_path": output, "model_config": {"model": MODEL}, "content": content, **fields}


def _confined_to(tmp_path, **maxima) -> tuple:
    """A data root under `tmp_path`, and a policy confining local paths to it, hardware within `maxima`."""
    root = tmp_path / "data"
    root.mkdir()
    policy = AdmissionPolicy(
        paths=PathPolicy(frozenset({"file", "local"}), (root.resolve(),)),
        tenants_file="",
        allow_remote_code=False,
        engine_maxima={},
        hardware_maxima=hardware_maxima(maxima),
    )
    return root, policy


def _service_of(policy: AdmissionPolicy, home: Path) -> BatchJobService:
    """The API's service over a fresh job store in `home`, holding requests to `policy`."""
    home.mkdir()
    return BatchJobService(
        JobStore(f"sqlite:///{home}/jobs.db"),
        dg.DagsterInstance.ephemeral(),
        JobStorage(work_dir_base=settings().work_dir_base),
        admission=policy,
        fair_share_half_life_s=3600,
        dry_runs=DryRuns.of_deployment(settings()),
    )


def test_the_api_holds_requests_to_the_policy_its_service_was_given(tmp_path, monkeypatch):
    for name in ("BATCH_PIPELINE_DATA_ROOTS", "BATCH_PIPELINE_MAX_GPUS", "BATCH_PIPELINE_TENANTS"):
        monkeypatch.delenv(name, raising=False)  # the environment bounds nothing
    root, policy = _confined_to(tmp_path, gpus=2)
    service = _service_of(policy, tmp_path / "home")
    with TestClient(create_app(service, ApiKeys([KEY]))) as client:

        def post(body: dict):
            return client.post("/v2/batch-completions", json=body, headers={"x-api-key": KEY})

        outside = post(_body(str(tmp_path / "elsewhere" / "out.json")))
        assert outside.status_code == 422, outside.text
        assert [problem["loc"][-1] for problem in outside.json()["detail"]] == ["output_data_path"]
        too_many = post(_body(str(root / "out.json"), gpus=3))
        assert too_many.status_code == 422 and too_many.json()["detail"][0]["loc"][-1] == "gpus", too_many.text
        assert post(_body(str(root / "out.json"), gpus=2)).status_code == 200


def test_a_jobs_ops_hold_its_request_to_their_admission_resource(tmp_path, monkeypatch):
    monkeypatch.delenv("BATCH_PIPELINE_DATA_ROOTS", raising=False)
    _, policy = _confined_to(tmp_path)
    defs = dg.Definitions(
        jobs=[batch_completions],
        resources={
            "admission": dg.ResourceDefinition.hardcoded_resource(policy),
            "job_store": JobStoreResource(url=f"sqlite:///{tmp_path}/jobs.db"),
            "job_storage": JobStorage(work_dir_base=str(tmp_path / "work")),
            "shard_launcher": LocalShardLauncher(),
            "shard_planning": ShardPlanning(max_shards_per_job=None, min_shard_tokens=0, deduplicate=True),
        },
    )
    job = defs.get_job_def("batch_completions")
    request = CreateBatchCompletionsV2Request.model_validate(_body(str(tmp_path / "elsewhere" / "out.json")))
    with dg.instance_for_test() as instance:
        result = job.execute_in_process(run_config=run_config_for(request), instance=instance, raise_on_error=False)
    assert not result.success
    (message,) = step_failure_messages(result)
    assert "Failure: output_data_path: outside the data roots" in message, message


def test_the_api_knows_its_callers_by_the_tenants_file_of_its_policy(tmp_path, monkeypatch):
    """Login, the usage report and the metrics read the teams of the policy the service was given: a team's
    key acts for its team, a key the file does not hold is refused, though the environment names no file."""
    for name in ("BATCH_PIPELINE_TENANTS", "BATCH_PIPELINE_API_KEYS", "BATCH_PIPELINE_API_KEYS_FILE"):
        monkeypatch.delenv(name, raising=False)
    root, policy = _confined_to(tmp_path)
    tenants_file = tmp_path / "tenants.yaml"
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    tenants_file.write_text(f'tenants:\n  team-a:\n    api_keys_sha256: [{digest}]\n    data_roots: ["{root}"]\n')
    policy = dataclasses.replace(policy, tenants_file=str(tenants_file))
    service = _service_of(policy, tmp_path / "home")
    with TestClient(create_app(service)) as client:
        assert client.get("/v2/usage", headers={"x-api-key": "not-in-the-file"}).status_code == 401
        created = client.post("/v2/batch-completions", json=_body(str(root / "out.json")), headers={"x-api-key": KEY})
        assert created.status_code == 200, created.text
        usage = client.get("/v2/usage", headers={"x-api-key": KEY})
        assert usage.status_code == 200, usage.text
        assert [(team["team"], team["jobs"]) for team in usage.json()["teams"]] == [("team-a", 1)]
        metrics = client.get("/metrics", headers={"x-api-key": KEY})
        assert metrics.status_code == 403, metrics.text  # a team's key is no admin's
